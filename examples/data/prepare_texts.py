"""Build the general-domain texts that recover and evaluate converted models beside the Python docs.

Two books from Debian's archive, fetched with ``apt-get download`` (no root, no install) and unpacked with
``dpkg-deb -x``; each package is pinned to one version and checked against its SHA-256:

- ``austen/``: Jane Austen's six completed novels (1811-1818, public domain), from ``r-cran-janeaustenr``
  (MIT), where they are R character vectors (one line of the Project Gutenberg text each) in the package's
  lazy-load database ``data/Rdata.rdb``. A small reader of R's serialisation format below gets them out without R.
  Each novel is one document (long-range structure is what the long windows measure); ``Persuasion`` is held out
  (``--eval-title``), the five others train. Hard-wrapped lines are joined into paragraphs, ``_italics_`` lose
  their underscores, indented blocks (verse, letters) keep their lines, and the editors' notes go.
- ``copyright_does_not_exist/``: Linus Walleij's *Copyright Does Not Exist* (1995, English translation; public
  domain), a non-fiction book on hacker culture, from ``cfi-en``'s HTML, one chapter a page. The whole book is one
  document and an evaluation text only: no recipe trains on it.

Writes, under ``--out-dir`` (this folder by default), ``austen/{train,eval}.jsonl.xz`` and
``copyright_does_not_exist/eval.jsonl.xz`` (one ``{"title", "text"}`` record per line), and beside each its
``LICENSE.txt`` (the package's copyright file) and ``SOURCE.txt``. The output is byte-for-byte deterministic.

    python examples/data/prepare_texts.py                      # downloads the two .deb files
    python examples/data/prepare_texts.py --deb-dir DIR        # or reads them from DIR
"""

import argparse
import gzip
import hashlib
import html.parser
import json
import lzma
import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    sha256: str

    @property
    def deb(self) -> str:
        return f"{self.name}_{self.version}_all.deb"


AUSTEN = Package("r-cran-janeaustenr", "1.0.0-1", "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95")
CDNE = Package("cfi-en", "3.0-10.2", "a080fc8f3b1a36c645b22f769fec4acc2f0cded42bcc5d5865c846845c897da2")

# janeaustenr's object names -> titles, in order of publication.
NOVELS = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
# Notes by later editors, not Austen's text: a printer's colophon, and a note that runs to the end of the book.
EDITORIAL_BLOCK = re.compile(r"^\s*\[End volume one of this edition\.")
EDITORIAL_TAIL = "A NOTE ON THE TEXT"
ITALICS = re.compile(r"_([^_\n]+)_")

# cfi-en's pages in reading order.
CDNE_PAGES = ["preface.htm", *(f"ch{n}web.htm" for n in range(1, 18)), "ottoen.htm"]
CDNE_TITLE = "Copyright Does Not Exist"


def fetch(package: Package, deb_dir: Path | None, work: Path) -> Path:
    """The unpacked package: its .deb from `deb_dir` or `apt-get download`, checked, then `dpkg-deb -x`."""
    for tool in ("dpkg-deb",) if deb_dir is not None else ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: run this on Debian or Ubuntu, which unpack .deb files with dpkg-deb")
    if deb_dir is not None:
        deb = deb_dir / package.deb
        if not deb.is_file():
            raise SystemExit(f"{deb} not found: apt-get download {package.name}={package.version}")
    else:
        result = subprocess.run(
            ["apt-get", "download", f"{package.name}={package.version}"],
            cwd=work,
            capture_output=True,
            text=True,
            check=False,
        )
        deb = work / package.deb
        if result.returncode != 0 or not deb.is_file():
            reason = result.stderr.strip().splitlines()[-1:] or ["no file"]
            raise SystemExit(
                f"apt-get download {package.name}={package.version} failed ({reason[0]}): "
                "run apt-get update, or pass --deb-dir with the .deb"
            )
    digest = hashlib.sha256(deb.read_bytes()).hexdigest()
    if digest != package.sha256:
        raise SystemExit(f"{deb}: SHA-256 {digest}, expected {package.sha256}: not the pinned package")
    root = work / package.name
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


# R's serialisation format (XDR, versions 2 and 3): just what janeaustenr's data holds.

NIL, SYMBOL, PAIRLIST, CHARS, LOGICAL, INTEGER, REAL, STRINGS, LIST, REFERENCE = 254, 1, 2, 9, 10, 13, 14, 16, 19, 255


class RUnserializer:
    """Reads one object written by R's `serialize(xdr = TRUE)`: NULL, symbols, pairlists, and logical, integer,
    double, character and list vectors; a vector with a `names` attribute becomes a dict."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.references = data, 0, []

    def _take(self, n: int) -> bytes:
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def _int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def read(self) -> object:
        if self._take(2) != b"X\n":
            raise ValueError("not an R XDR serialisation")
        version = self._int()
        self._int(), self._int()  # the writer's and the minimal reader's R versions
        if version == 3:
            self._take(self._int())  # native encoding
        return self._item()

    def _item(self) -> object:
        flags = self._int()
        kind, has_attributes, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == NIL:
            return None
        if kind == REFERENCE:
            return self.references[(flags >> 8) - 1]
        if kind == SYMBOL:
            symbol = self._item()
            self.references.append(symbol)
            return symbol
        if kind == CHARS:
            length = self._int()
            return None if length == -1 else self._take(length).decode("utf-8")
        if kind == PAIRLIST:
            if has_attributes:
                self._item()
            tag = self._item() if has_tag else None
            head = [(tag, self._item())]
            tail = self._item()
            return head + (tail or [])
        length = self._int()
        if kind in (LOGICAL, INTEGER):
            value = list(struct.unpack(f">{length}i", self._take(4 * length)))
        elif kind == REAL:
            value = list(struct.unpack(f">{length}d", self._take(8 * length)))
        elif kind in (STRINGS, LIST):
            value = [self._item() for _ in range(length)]
        else:
            raise ValueError(f"R object type {kind} is not supported by this reader")
        if has_attributes:
            names = dict(self._item()).get("names")
            if names is not None:
                return dict(zip(names, value, strict=True))
        return value


def read_lazy_load_db(prefix: Path) -> dict[str, object]:
    """The objects of R's lazy-load database `prefix.rdb` / `prefix.rdx` (zlib-compressed entries)."""
    index = RUnserializer(gzip.decompress(prefix.with_suffix(".rdx").read_bytes())).read()
    if index["compressed"] != [1]:
        raise ValueError(f"{prefix}.rdb: compression {index['compressed']} is not zlib")
    database = prefix.with_suffix(".rdb").read_bytes()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        entry = database[int(offset) : int(offset) + int(length)]
        objects[name] = RUnserializer(zlib.decompress(entry[4:])).read()  # entry[:4]: uncompressed length
    return objects


def austen_text(lines: list[str]) -> str:
    """One novel's Project Gutenberg lines as plain text: paragraphs on one line, indented blocks line by line."""
    paragraphs, block = [], []
    for line in [*lines, ""]:
        if line.strip():
            block.append(line)
            continue
        if not block:
            continue
        if block[0].strip() == EDITORIAL_TAIL:
            break
        if not EDITORIAL_BLOCK.match(block[0]):
            if block[0].startswith(" "):
                paragraphs.append("\n".join(" ".join(line.split()) for line in block))
            else:
                paragraphs.append(" ".join(" ".join(block).split()))
        block = []
    return ITALICS.sub(r"\1", "\n\n".join(paragraphs)) + "\n"


class PageText(html.parser.HTMLParser):
    """The text of one of cfi-en's pages: `<p>`, `<div>`, table cells and block quotes end paragraphs, `<br>` ends a
    line, numeric footnote marks become `[n]`; the title, navigation and credits are dropped."""

    BLOCKS = {"p", "div", "blockquote", "table", "tr", "td", "hr", "center", "h1", "h2", "h3", "li", "ul", "ol"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0  # inside <title> or <head>
        self.footnote: list[str] | None = None  # inside <sup>

    def handle_starttag(self, tag, attrs):
        if tag in ("title", "head"):
            self.skip += 1
        elif tag == "sup":
            self.footnote = []
        elif tag == "br":
            self.parts.append("\n")
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in ("title", "head"):
            self.skip -= 1
        elif tag == "sup" and self.footnote is not None:
            mark = "".join(self.footnote).strip(" ()")
            self.footnote = None
            if mark:
                self.parts.append(f"[{mark}]" if mark.isdigit() else mark)  # a footnote mark, or "rd" in "3rd"
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if self.skip:
            return
        data = re.sub(r"\s+", " ", data)
        (self.footnote if self.footnote is not None else self.parts).append(data)

    def text(self) -> str:
        paragraphs = []
        for paragraph in re.split(r"\n\s*\n", "".join(self.parts)):
            lines = [" ".join(line.split()) for line in paragraph.split("\n")]
            paragraph = "\n".join(line for line in lines if line)
            paragraph = re.sub(r" +([,.;:!?)])", r"\1", paragraph).replace("( ", "(")
            if paragraph and paragraph != "INDEX" and not paragraph.startswith("Design and formatting by"):
                paragraphs.append(paragraph)
        return "\n\n".join(paragraphs)


def cdne_text(html_dir: Path) -> str:
    pages = []
    for name in CDNE_PAGES:
        parser = PageText()
        parser.feed((html_dir / name).read_text(encoding="latin-1"))
        parser.close()
        pages.append(parser.text())
    return "\n\n".join(pages) + "\n"


def write_jsonl_xz(path: Path, records: list[dict[str, str]]) -> None:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    path.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))


def report(path: Path, records: list[dict[str, str]]) -> None:
    chars = sum(len(r["text"]) for r in records)
    print(f"{path}: {len(records)} documents, {chars:,} characters")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deb-dir", type=Path, help=f"folder holding {AUSTEN.deb} and {CDNE.deb}")
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("--eval-title", default="Persuasion", choices=list(NOVELS.values()), help="the novel held out")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        austen_root = fetch(AUSTEN, args.deb_dir, work)
        cdne_root = fetch(CDNE, args.deb_dir, work)
        novels = read_lazy_load_db(austen_root / "usr/lib/R/site-library/janeaustenr/data/Rdata")
        if set(novels) != set(NOVELS):
            raise SystemExit(f"{AUSTEN.deb}: expected the objects {sorted(NOVELS)}, found {sorted(novels)}")
        austen = {"train": [], "eval": []}
        for name, title in NOVELS.items():
            austen["eval" if title == args.eval_title else "train"].append(
                {"title": title, "text": austen_text(novels[name])}
            )
        cdne = [{"title": CDNE_TITLE, "text": cdne_text(cdne_root / "usr/share/doc/cfi-en/html")}]

        austen_dir, cdne_dir = args.out_dir / "austen", args.out_dir / "copyright_does_not_exist"
        for folder in (austen_dir, cdne_dir):
            folder.mkdir(parents=True, exist_ok=True)
        for split, records in austen.items():
            write_jsonl_xz(austen_dir / f"{split}.jsonl.xz", records)
            report(austen_dir / f"{split}.jsonl.xz", records)
        write_jsonl_xz(cdne_dir / "eval.jsonl.xz", cdne)
        report(cdne_dir / "eval.jsonl.xz", cdne)
        (austen_dir / "LICENSE.txt").write_bytes(
            (austen_root / "usr/share/doc/r-cran-janeaustenr/copyright").read_bytes()
        )
        (cdne_dir / "LICENSE.txt").write_bytes((cdne_root / "usr/share/doc/cfi-en/copyright").read_bytes())

    built_by = "Built by: python examples/data/prepare_texts.py"
    (austen_dir / "SOURCE.txt").write_text(
        f"Source: Debian package {AUSTEN.name}, version {AUSTEN.version} ({AUSTEN.deb}, SHA-256 {AUSTEN.sha256})\n"
        "Files: usr/lib/R/site-library/janeaustenr/data/Rdata.{rdb,rdx} (R lazy-load database, one character\n"
        "  vector of Project Gutenberg lines per novel)\n"
        "Text: Jane Austen's six completed novels (1811-1818), in the public domain; the R package (Julia Silge)\n"
        "  is under the MIT licence in LICENSE.txt (the package's copyright file)\n"
        f"Split: by novel; eval.jsonl.xz holds {args.eval_title}, train.jsonl.xz the five others\n"
        f"{built_by} (paragraphs unwrapped, _italics_ marks and the editors' notes removed)\n"
    )
    (cdne_dir / "SOURCE.txt").write_text(
        f"Source: Debian package {CDNE.name}, version {CDNE.version} ({CDNE.deb}, SHA-256 {CDNE.sha256})\n"
        f"Files: usr/share/doc/cfi-en/html/{{{','.join(CDNE_PAGES)}}}\n"
        "Text: Linus Walleij, Copyright Does Not Exist (1995), translated from Swedish by Daniel Arnrup;\n"
        "  public domain according to the package's copyright file (LICENSE.txt); the book's preface also\n"
        "  allows free electronic copying and distribution\n"
        "Split: none; the whole book is one document, for evaluation only (no recipe trains on it)\n"
        f"{built_by} (HTML to text: paragraphs and line breaks kept, navigation dropped, footnote marks as [n])\n"
    )


if __name__ == "__main__":
    main()
