#!/usr/bin/env python3
"""Extracts the King James Bible from Debian's bible-kjv package into plain text.

Reproducible: the text comes from `bible` (package bible-kjv 4.38, data in bible-kjv-text), the
output depends on nothing else. One chapter per paragraph: a heading line ("Genesis 1"), then one
verse per line without its number, then a blank line. Some books are held out for evaluation.

    python3 extract_corpus.py OUTDIR      -> OUTDIR/train.txt, OUTDIR/heldout.txt
"""
import re
import subprocess
import sys
from pathlib import Path

# Books never seen in training: a mix of narrative, poetry, prophecy and letters.
HELDOUT = {"Ruth", "Esther", "Lamentations", "Jonah", "Habakkuk", "Titus", "Philemon", "James",
           "3 John", "Jude"}


def chapters(text):
    """Yields (book, chapter, [verses]) from `bible -l10000` output."""
    book = chapter = None
    verses = []
    for line in text.splitlines():
        m = re.match(r"^  (\d+) (.*)$", line)
        if m:
            verses.append(m.group(2).strip())
            continue
        if not line.strip():
            continue
        h = re.match(r"^(.+) (\d+)$", line)
        if not h:
            raise SystemExit(f"unexpected line from bible: {line!r}")
        if book is not None:
            yield book, chapter, verses
        book, chapter, verses = h.group(1), int(h.group(2)), []
    if book is not None:
        yield book, chapter, verses


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    raw = subprocess.run(["bible", "-l10000", "Gen1:1-Rev22:21"], check=True,
                         capture_output=True, text=True).stdout
    train, held = [], []
    n_verses = 0
    for book, chapter, verses in chapters(raw):
        n_verses += len(verses)
        para = f"{book} {chapter}\n" + "\n".join(verses) + "\n\n"
        (held if book in HELDOUT else train).append(para)
    if n_verses != 31102:
        raise SystemExit(f"expected 31102 verses, got {n_verses}: is this bible-kjv 4.38?")
    (out / "train.txt").write_text("".join(train))
    (out / "heldout.txt").write_text("".join(held))
    print(f"{n_verses} verses: train {sum(map(len, train))} chars, "
          f"held out {sum(map(len, held))} chars ({', '.join(sorted(HELDOUT))})")


if __name__ == "__main__":
    main()
