"""Links in the source folder: one whose target lies outside it (a licence, notes, a weight file, a GGUF) is refused,
naming each link and its target, unless `--follow-symlinks`, which copies what they point to and names them; links
inside the source, and a hub snapshot's links into its cache's blobs, need no flag."""

import hashlib
import json
import os
import shutil

import pytest

from path_hf.conversion.verify import TEXT_FILE
from tests.conversion.checkpoints import make_source, read_tensors, run_cli
from tests.conversion.gguf_files import tiny_model, write_gguf

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def outside_files(tmp_path):
    """Two files of someone's, outside any source folder."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("a secret")
    (elsewhere / "hostname").write_text("node1")
    return elsewhere / "secret.txt", elsewhere / "hostname"


def assert_nothing_written(tmp_path, output):
    assert not output.exists()
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(f".{output.name}.")]


@pytest.mark.parametrize("dry_run", [False, True])
def test_links_out_of_the_source_are_refused(dry_run, tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", tokenizer=True)
    secret, hostname = outside_files(tmp_path)
    (source / "LICENSE").symlink_to(secret)
    (source / "notes.txt").symlink_to(hostname)
    output = tmp_path / "converted"
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", output, *(["--dry-run"] if dry_run else []))
    assert code == 1 and out == ""
    assert err == (
        f"error: {source} has links to files outside it, which the conversion would read and copy into the output: "
        f"LICENSE -> {secret}, notes.txt -> {hostname}; remove them, or pass --follow-symlinks to copy what they "
        "point to.\n"
    )
    assert_nothing_written(tmp_path, output)


def test_follow_symlinks_copies_them_and_names_them(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", tokenizer=True)
    secret, hostname = outside_files(tmp_path)
    (source / "LICENSE").symlink_to(secret)
    (source / "notes.txt").symlink_to(hostname)
    output = tmp_path / "converted"
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", output, "--follow-symlinks")
    assert code == 0, err
    assert f"following links out of {source} (--follow-symlinks): LICENSE -> {secret}, notes.txt -> {hostname}\n" in out
    assert (output / "LICENSE").read_text() == "a secret" and not (output / "LICENSE").is_symlink()
    assert (output / "notes.txt").read_text() == "node1"
    assert "follow_symlinks" not in json.loads((output / "config.json").read_text())["path_conversion"]["options"]


def test_links_inside_the_source_need_no_flag(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", tokenizer=True)
    (source / "docs").mkdir()
    (source / "docs" / "LICENSE.txt").write_text("Apache-2.0")
    (source / "LICENSE").symlink_to("docs/LICENSE.txt")
    (source / "tokenizer.json").rename(source / "docs" / "tokenizer.json")
    (source / "tokenizer.json").symlink_to(source / "docs" / "tokenizer.json")
    output = tmp_path / "converted"
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", output, "--verify")
    assert code == 0, err
    assert "following links" not in out
    assert (output / "LICENSE").read_text() == "Apache-2.0"
    assert (output / "tokenizer.json").read_bytes() == (source / "docs" / "tokenizer.json").read_bytes()


def test_weights_through_a_link_out_of_the_source(tmp_path, capsys):
    """A shard read through a link is refused like any file; so is an index that names a shard outside the folder."""
    source = make_source(tmp_path / "source", "llama", max_shard_size="100KB")
    shard = "model-00002-of-00006.safetensors"
    moved = tmp_path / "elsewhere" / shard
    moved.parent.mkdir()
    shutil.move(source / shard, moved)
    (source / shard).symlink_to(moved)
    output = tmp_path / "converted"
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output)
    assert code == 1 and f": {shard} -> {moved}; remove them, or pass --follow-symlinks" in err, err
    assert_nothing_written(tmp_path, output)

    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", output, "--follow-symlinks")
    assert code == 0, err
    assert f"(--follow-symlinks): {shard} -> {moved}\n" in out
    copied = read_tensors(output)
    assert all(copied[name].equal(tensor) for name, tensor in read_tensors(tmp_path / "elsewhere").items())
    shutil.rmtree(output)

    (source / shard).unlink()
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        name: f"../elsewhere/{shard}" if file == shard else file for name, file in index["weight_map"].items()
    }
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output)
    assert code == 1 and f": ../elsewhere/{shard} -> {moved}; remove them" in err, err
    assert_nothing_written(tmp_path, output)


def hub_cache(tmp_path, monkeypatch, repo_id: str = "tiny/llama"):
    """A hub cache holding `repo_id` at COMMIT as huggingface_hub writes one: a snapshot folder of links into the
    repository's blobs, named by their hashes; offline. Returns the snapshot."""
    saved = make_source(tmp_path / "saved", "llama", tokenizer=True)
    repo = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in saved.iterdir():
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.rmtree(saved)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    return snapshot


def test_a_hub_snapshot_is_made_of_links_into_its_blobs(tmp_path, capsys, monkeypatch):
    snapshot = hub_cache(tmp_path, monkeypatch)
    assert (snapshot / "model.safetensors").is_symlink() and (snapshot / "tokenizer.json").is_symlink()
    for source in ("tiny/llama", snapshot):  # a hub id, or the snapshot folder as a local source
        output = tmp_path / "converted"
        code, out, err = run_cli(capsys, "convert", "--from", source, "--to", output, "--force")
        assert code == 0, err
        assert "following links" not in out
        assert (output / "tokenizer.json").read_bytes() == (snapshot / "tokenizer.json").read_bytes()
        assert not (output / "tokenizer.json").is_symlink()

    # A link in the snapshot that leads out of the repository's blobs is refused as anywhere else.
    (snapshot / "notes.txt").symlink_to(TEXT_FILE)
    code, _, err = run_cli(capsys, "convert", "--from", "tiny/llama", "--to", tmp_path / "other")
    assert code == 1 and f"{snapshot} has links to files outside it" in err and f"notes.txt -> {TEXT_FILE};" in err
    assert not (tmp_path / "other").exists()


def test_a_gguf_through_a_link_out_of_the_source_folder(tmp_path, capsys):
    (tmp_path / "elsewhere").mkdir()
    gguf_file = write_gguf(tmp_path / "elsewhere" / "model.gguf", tiny_model(), "llama", "F32", tokenizer=False)
    folder = tmp_path / "ggufs"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(gguf_file)
    output = tmp_path / "converted"
    code, _, err = run_cli(capsys, "convert", "--from", folder, "--to", output, "--dry-run")
    assert code == 1 and f"error: {folder} has links to files outside it" in err
    assert f": model.gguf -> {gguf_file}; remove them, or pass --follow-symlinks" in err
    assert_nothing_written(tmp_path, output)

    code, out, err = run_cli(capsys, "convert", "--from", folder, "--to", output, "--dry-run", "--follow-symlinks")
    assert code == 0, err
    assert f"following links out of {folder} (--follow-symlinks): model.gguf -> {gguf_file}\n" in out
    # The link itself as SRC names the file to read: followed without the flag.
    code, out, err = run_cli(capsys, "convert", "--from", folder / "model.gguf", "--to", output, "--dry-run")
    assert code == 0, err
    assert "following links" not in out
