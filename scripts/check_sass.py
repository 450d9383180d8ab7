"""Inspect the SASS of every marlin kernel instance in the built extension.

The published MARLIN kernel shipped an instance in which ptxas dropped the register holding the
L2 evict-first policy of its cp.async (it died with "illegal instruction"). Here each weight copy
creates its policy in the same asm statement; this script checks, per kernel, that the weight
copies (LDGSTS) carry a cache-policy operand and that the policy is produced in that kernel, and
prints a per-kernel instruction summary. Exits non-zero on a kernel without it.

    python scripts/check_sass.py [path/to/_C.so]
"""

import collections
import glob
import os
import re
import subprocess
import sys


def main():
    so = sys.argv[1] if len(sys.argv) > 1 else None
    if so is None:
        here = os.path.join(os.path.dirname(__file__), "..", "marlin")
        found = glob.glob(os.path.join(here, "_C*.so"))
        if not found:
            print("no marlin/_C*.so found; build first")
            return 2
        so = found[0]
    sass = subprocess.run(["cuobjdump", "-sass", so], capture_output=True, text=True, check=True).stdout
    kernels = re.split(r"\n\s*Function : ", sass)[1:]
    if not kernels:
        print("no kernels in", so)
        return 2
    bad = 0
    for body in kernels:
        name = body.split("\n", 1)[0].strip()
        ops = collections.Counter(re.findall(r"\b(LDGSTS|HMMA|LDSM|LOP3|HFMA2|HADD2|HMUL2|BAR|LDS|STS|LDG|STG|UMOV)\b[\.\w]*", body))
        ldgsts = [l for l in body.splitlines() if "LDGSTS" in l]
        with_policy = [l for l in ldgsts if re.search(r"desc\[|\.EF|EVICT", l)]
        print(f"{name[:90]}: {dict(ops)}")
        print(f"   LDGSTS {len(ldgsts)}, with a cache-policy operand {len(with_policy)}")
        for l in ldgsts[:3]:
            print("     ", l.strip()[:140])
        if not ldgsts or not with_policy:
            bad += 1
    print(f"{len(kernels)} kernels, {bad} without evict-first weight copies")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
