"""Whether the numbers that keep GPT-2's lengths from deriving are loose (GPU, then CPU).

``benchmarks/derive_words.py`` found that of the numbers varying across a GPT-2 small decode
family's lengths, most lie on no line and look like host memory (PyTorch's unfilled argument
slots). If they are, two captures of the same length differ in them, and a derivation could
leave them out of its fits and its byte-for-byte checks. This captures the family over KV
lengths 240..255 twice in one process and compares.

``python benchmarks/repeat_capture_words.py capture DIR`` (GPU): both families saved as
``DIR/a.family.json.gz`` and ``DIR/b.family.json.gz``, then ``compare`` run on them.
``python benchmarks/repeat_capture_words.py compare A B`` (CPU; A and B may come from two
processes): for the largest executable of A, its numbers that vary and lie on no line
(``grape.passes.derive``), and of their argument words outside any pointer, how many differ
between A and B at the same length, by kernel.

Run on the H200 at e8bbd38 (``results/families_warm_start_h200/repeat_capture_words_e8bbd38.log``):
199 of the 248 words differ between the two captures, 49 do not (benchmarks/README.md,
"Derived lengths"). That run read 64-bit words; since ``grape.passes.derive`` reads 32-bit slots
and computes divider multipliers itself, ``compare`` on the same two files finds 235 words on no
line, 199 loose and 36 not.
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

from grape.familyio import load_family
from grape.passes.derive import derive

LENGTHS = list(range(240, 256))


def capture(folder: Path) -> tuple[Path, Path]:
    sys.path.insert(0, os.path.dirname(__file__))
    from families import gpt2_decode

    from grape.torch.family import capture_family

    folder.mkdir(parents=True, exist_ok=True)
    w = gpt2_decode(1, LENGTHS)
    paths = []
    for name in ("a", "b"):
        family = capture_family(w.step, sorted(LENGTHS, reverse=True), w.params)
        paths.append(family.save(folder / f"{name}.family.json.gz", w.params))
        family.close()
    return paths[0], paths[1]


def _word_under_pointer(op, word: int) -> bool:
    return any(p.offset < 8 * word + 8 and 8 * word < p.offset + 8 for p in op.pointers)


def compare(a_path: Path, b_path: Path) -> None:
    a, b = load_family(a_path), load_family(b_path)
    by_key = collections.defaultdict(list)
    for length, (key, _) in a.members.items():
        by_key[key].append(length)
    key, lengths = max(by_key.items(), key=lambda kv: len(kv[1]))
    lengths = sorted(n for n in lengths if n in b.members)
    graphs = {n: a.graph(n) for n in lengths}
    fits = derive(graphs).fits
    off_line = [k for k, segments in fits.items() if len(segments) > 1]
    # derive reads 32-bit slots ("a{byte offset}"): the words that hold one
    words = sorted({(node, int(what[1:]) // 8) for node, what in off_line
                    if what.startswith("a")
                    and not _word_under_pointer(graphs[lengths[0]].op(node), int(what[1:]) // 8)})
    loose, fixed = collections.Counter(), collections.Counter()
    for node, word in words:
        differs = False
        for n in lengths:
            mine, theirs = a.graph(n).op(node), b.graph(n).op(node)
            if mine.args[8 * word:8 * word + 8] != theirs.args[8 * word:8 * word + 8]:
                differs = True
                break
        name = graphs[lengths[0]].op(node).name[:48]
        (loose if differs else fixed)[name] += 1
    print(f"executable {key[:8]}, lengths {lengths[0]}..{lengths[-1]} ({len(lengths)}): "
          f"{len(fits)} numbers vary, {len(off_line)} on no line, {len(words)} of those "
          f"argument words outside pointers; {sum(loose.values())} differ between the two "
          f"captures of a length (loose), {sum(fixed.values())} do not")
    for label, counts in (("loose", loose), ("not loose", fixed)):
        for name, count in counts.most_common(8):
            print(f"  {label:9s} {count:4d} in {name}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "capture":
        compare(*capture(Path(sys.argv[2])))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        compare(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit(__doc__.split("\n\n")[2])
