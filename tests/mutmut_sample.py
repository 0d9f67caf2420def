"""Mutation-score helper for ``make mutate`` / ``make mutate-sample`` (reads mutmut's ``mutants/**/*.meta``).

    python tests/mutmut_sample.py names [--share 0.1] [--seed 20] [--unchecked]   # the sample's mutant names
    python tests/mutmut_sample.py score [--share 0.1] [--seed 20] [--all]         # per-module kill rate
    python tests/mutmut_sample.py equivalent-diffs   # what each listed equivalent mutant changes today
    python tests/mutmut_sample.py survivors          # every survivor with its kept reason (or "NO REASON")

The sample takes ``share`` of each module's mutants (at least 8), drawn with a fixed seed, so a sample run
is reproducible for one mutmut version and one state of the code. Mutants listed in
``tests/mutmut_equivalent*.txt`` (name, then the reason) are equivalent: no test can kill them, and they are
left out of the score. Survivors that are not equivalent but are kept (a CUDA-only branch, say) are listed
with their reason in ``tests/mutmut_kept*.txt``; they stay in the score as survivors.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

META_ROOT = Path("mutants/amplite")
TESTS = Path(__file__).parent
EQUIVALENT_GLOB = "mutmut_equivalent*.txt"  # one file per area, so that parallel work does not collide
KEPT_GLOB = "mutmut_kept*.txt"
KILLED = {1, 3, -11, -9, 36, -24, 24, 152, 255}  # failed, pytest error, crash, timeout
SURVIVED = {0, 5, 33}  # passed, or no test reaches the function
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 36: "timeout", -24: "timeout",
          24: "timeout", 152: "timeout", 255: "timeout", -11: "crash", -9: "crash", None: "unchecked"}


def _modules() -> dict[str, dict[str, int | None]]:
    return {
        str(meta)[len("mutants/") : -len(".meta")]: json.loads(meta.read_text())["exit_code_by_key"]
        for meta in sorted(META_ROOT.rglob("*.py.meta"))
    }


def sample(share: float, seed: int) -> dict[str, list[str]]:
    """The sampled mutant names of each module."""
    rng = random.Random(seed)
    out = {}
    for path, codes in _modules().items():
        keys = sorted(codes)
        if keys:
            out[path] = rng.sample(keys, min(len(keys), max(8, round(len(keys) * share))))
    return out


def _listed(glob: str) -> dict[str, str]:
    """Mutant name -> reason, from every file matching ``glob`` beside this script."""
    out: dict[str, str] = {}
    for path in sorted(TESTS.glob(glob)):
        lines = path.read_text(encoding="utf-8").splitlines()
        pairs = (line.split(None, 1) for line in lines if line.strip() and not line.startswith("#"))
        out.update({p[0]: (p[1] if len(p) > 1 else "") for p in pairs})
    return out


def equivalent() -> dict[str, str]:
    """Mutant name -> why it is equivalent."""
    return _listed(EQUIVALENT_GLOB)


def kept() -> dict[str, str]:
    """Surviving (not equivalent) mutant name -> why no test kills it."""
    return _listed(KEPT_GLOB)


def survivors() -> None:
    """Print every survivor of the cached run with its kept reason, ``NO REASON`` where none is listed."""
    eq, why = equivalent(), kept()
    for codes in _modules().values():
        for name in sorted(codes):
            if codes[name] in SURVIVED and name not in eq:
                print(f"{name}  {why.get(name, 'NO REASON')}")


def score(names_by_module: dict[str, list[str]]) -> None:
    """Print killed / (checked - equivalent) per module and in total, then the survivors."""
    codes_by_module, eq = _modules(), equivalent()
    total: Counter[str] = Counter()
    survivors = []
    print(f"{'module':42s} {'mutants':>7s} {'killed':>6s} {'surv.':>5s} {'equiv.':>6s} {'unchk.':>6s} {'score':>6s}")
    for path, names in names_by_module.items():
        c: Counter[str] = Counter()
        for name in names:
            code = codes_by_module[path].get(name)
            if code is None:
                c["unchecked"] += 1
            elif name in eq:
                c["equivalent"] += 1
            elif code in KILLED:
                c["killed"] += 1
            elif code in SURVIVED:
                c["survived"] += 1
                survivors.append(name)
            else:
                c["other"] += 1
        judged = c["killed"] + c["survived"]
        rate = f"{c['killed'] / judged:.0%}" if judged else "-"
        print(f"{path:42s} {len(names):7d} {c['killed']:6d} {c['survived']:5d} {c['equivalent']:6d} "
              f"{c['unchecked']:6d} {rate:>6s}")
        total.update(c)
    judged = total["killed"] + total["survived"]
    print(f"{'total':42s} {sum(map(len, names_by_module.values())):7d} {total['killed']:6d} {total['survived']:5d} "
          f"{total['equivalent']:6d} {total['unchecked']:6d} {total['killed'] / max(1, judged):6.1%}")
    tally = Counter(
        STATUS.get(codes_by_module[p].get(n), "suspicious") for p, ns in names_by_module.items() for n in ns
    )
    print("by mutmut status:", ", ".join(f"{k} {v}" for k, v in tally.most_common()))
    by_function = Counter(name.rsplit("__mutmut_", 1)[0] for name in survivors)
    for function, n in by_function.most_common():
        print(f"survived: {n:3d} {function}")
    for name in survivors:
        print("survived:", name)


def equivalent_diffs() -> None:
    """Print each listed equivalent mutant's changed lines, so entries can be checked after a code change.

    Mutant names are numbered per function: after an edit to a listed function the number may name another
    mutation. An entry whose diff no longer matches its reason (or that no longer exists) must be renamed.
    """
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    codes = _modules()
    for name, reason in equivalent().items():
        module = name.split(".x")[0]
        path = module.replace(".", "/") + ".py"
        if name not in codes.get(path, {}):
            print(f"MISSING {name}  ({reason})")
            continue
        diff = get_diff_for_mutant(name, path=path)
        changed = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
        print(f"{name}  ({reason})")
        for line in changed:
            print("   ", line.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["names", "score", "equivalent-diffs", "survivors"])
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--unchecked", action="store_true", help="names: only those without a result yet")
    parser.add_argument("--all", action="store_true", help="score: every mutant, not the sample")
    args = parser.parse_args()
    if args.command == "equivalent-diffs":
        equivalent_diffs()
    elif args.command == "survivors":
        survivors()
    elif args.command == "names":
        codes = _modules()
        for path, names in sample(args.share, args.seed).items():
            for name in names:
                if not args.unchecked or codes[path].get(name) is None:
                    print(name)
    else:
        score({p: sorted(c) for p, c in _modules().items() if c} if args.all else sample(args.share, args.seed))


if __name__ == "__main__":
    main()
