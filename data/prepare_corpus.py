"""Rebuild data/corpus.txt and data/heldout.txt from Debian's r-cran-janeaustenr package (see data/README.md).

    apt-get download r-cran-janeaustenr          # r-cran-janeaustenr_1.0.0-1_all.deb (Debian 12 "bookworm")
    python data/prepare_corpus.py r-cran-janeaustenr_1.0.0-1_all.deb

Standard library only: reads the .deb (an `ar` archive holding data.tar.*), the R lazy-load database
`usr/lib/R/site-library/janeaustenr/data/Rdata.{rdx,rdb}` inside it and the character vectors (one element per
line of the novel) stored there, then normalises the text as data/README.md describes.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import re
import struct
import tarfile
import zlib
from pathlib import Path


DATA_DIR = "usr/lib/R/site-library/janeaustenr/data/"
# (R object name, title) in corpus order.
BOOKS = (
    ("prideprejudice", "Pride and Prejudice"),
    ("sensesensibility", "Sense and Sensibility"),
    ("northangerabbey", "Northanger Abbey"),
    ("persuasion", "Persuasion"),
)
HELDOUT_CHAPTERS = 2  # the last two chapters of every book are held out
CHAPTER = re.compile(r"^chapter\s+\w+\.?$", re.IGNORECASE)
# Editorial matter that is not Austen's text: a modern note on the text at the end of Northanger Abbey.
CUT_FROM = {"northangerabbey": "A NOTE ON THE TEXT"}


# --- reading the .deb -----------------------------------------------------------------------------------------------


def read_deb_members(deb: Path, wanted: tuple[str, ...]) -> dict[str, bytes]:
    blob = deb.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        raise SystemExit(f"{deb} is not a .deb (ar) archive")
    pos, data_tar = 8, None
    while pos < len(blob):
        header = blob[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        if name.startswith("data.tar"):
            data_tar = blob[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
    if data_tar is None:
        raise SystemExit(f"{deb} holds no data.tar member")
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data_tar)) as tar:
        for member in tar.getmembers():
            path = member.name.lstrip("./")
            if path in wanted:
                out[path] = tar.extractfile(member).read()
    missing = set(wanted) - set(out)
    if missing:
        raise SystemExit(f"{deb} lacks {sorted(missing)}")
    return out


# --- a minimal reader for R's XDR serialization format (enough for the objects in this package) ---------------------


class _RReader:
    NILVALUE, REF, SYM, LIST, CHAR, LGL, INT, REAL, STR, VEC = 254, 255, 1, 2, 9, 10, 13, 14, 16, 19

    def __init__(self, data: bytes):
        if not data.startswith(b"X\n"):
            raise ValueError("not an XDR R serialization stream")
        self.data, self.pos, self.refs = data, 2, []
        version = self.int()
        self.int(), self.int()  # writer's R version, minimal reader version
        if version == 3:
            length = self.int()  # then the native encoding's name
            self.pos += length

    def int(self) -> int:
        (value,) = struct.unpack(">i", self.data[self.pos : self.pos + 4])
        self.pos += 4
        return value

    def read(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind == self.NILVALUE:
            return None
        if kind == self.REF:
            return self.refs[(flags >> 8) - 1]
        if kind == self.SYM:
            name = self.read()
            self.refs.append(name)
            return name
        if kind == self.CHAR:
            length = self.int()
            if length == -1:
                return None  # NA_character_
            value = self.data[self.pos : self.pos + length].decode("utf-8" if flags & (1 << 15) else "latin-1")
            self.pos += length
            return value
        if kind == self.LIST:  # pairlist: attributes, tag, value, rest
            attributes = self.read() if has_attr else None
            tag = self.read() if has_tag else None
            head, rest = self.read(), self.read()
            del attributes
            return [(tag, head)] + (rest or [])
        if kind in (self.LGL, self.INT, self.REAL, self.STR, self.VEC):
            length = self.int()
            if kind in (self.LGL, self.INT):
                value = list(struct.unpack(f">{length}i", self.data[self.pos : self.pos + 4 * length]))
                self.pos += 4 * length
            elif kind == self.REAL:
                value = list(struct.unpack(f">{length}d", self.data[self.pos : self.pos + 8 * length]))
                self.pos += 8 * length
            else:
                value = [self.read() for _ in range(length)]
            attributes = dict(self.read()) if has_attr else {}
            if "names" in attributes:
                return dict(zip(attributes["names"], value))
            return value
        raise ValueError(f"unsupported R object type {kind}")


def read_lazyload_db(rdx: bytes, rdb: bytes) -> dict[str, list[str]]:
    index = _RReader(gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else zlib.decompress(rdx[4:])).read()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[offset : offset + length]
        (size,) = struct.unpack(">I", blob[:4])
        raw = zlib.decompress(blob[4:])
        assert len(raw) == size, name
        objects[name] = _RReader(raw).read()
    return objects


# --- normalisation --------------------------------------------------------------------------------------------------


def paragraphs(lines: list[str | None]) -> list[str]:
    """Blank-line separated paragraphs, each unwrapped onto one line, `_emphasis_` markers removed."""
    out, current = [], []
    for line in lines + [""]:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            text = " ".join(current)
            text = re.sub(r"_([^_]+)_", r"\1", text).replace("_", "")
            out.append(re.sub(r"\s+", " ", text))
            current = []
    return out


def split_book(name: str, lines: list[str | None]) -> tuple[list[str], list[str]]:
    if name in CUT_FROM:
        lines = lines[: next(i for i, line in enumerate(lines) if (line or "").strip() == CUT_FROM[name])]
    paras = paragraphs(lines)
    chapter_starts = [i for i, p in enumerate(paras) if CHAPTER.match(p)]
    cut = chapter_starts[-HELDOUT_CHAPTERS]
    return paras[:cut], paras[cut:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("deb", type=Path, help="r-cran-janeaustenr_*.deb")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args(argv)
    members = read_deb_members(args.deb, (DATA_DIR + "Rdata.rdx", DATA_DIR + "Rdata.rdb"))
    objects = read_lazyload_db(members[DATA_DIR + "Rdata.rdx"], members[DATA_DIR + "Rdata.rdb"])
    train, heldout = [], []
    for name, title in BOOKS:
        book_train, book_heldout = split_book(name, objects[name])
        train.append("\n".join(book_train))
        heldout.append("\n".join(book_heldout))
        print(f"{title}: {len(book_train)} + {len(book_heldout)} paragraphs (train + held out)")
    for filename, books in (("corpus.txt", train), ("heldout.txt", heldout)):
        text = "\n\n".join(books) + "\n"
        (args.out / filename).write_text(text, encoding="utf-8")
        digest = hashlib.sha256(text.encode()).hexdigest()
        print(f"{filename}: {len(text.encode()):,} bytes, sha256 {digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
