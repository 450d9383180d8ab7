"""Inspect the SASS of every marlin kernel instance in the built extension.

The published MARLIN kernel shipped an instance in which ptxas dropped the register holding the
L2 evict-first policy of its cp.async: the copy referenced a descriptor register that nothing
wrote, and the kernel died with "illegal instruction". On sm_90 every global access names a
uniform memory-descriptor register pair (desc[URn]) that carries the cache policy. This script
checks, for every kernel, that
  * each LDGSTS (cp.async) names a descriptor register pair that an earlier instruction writes;
  * the weight copies use a descriptor other than the default one of the activation copies
    (i.e. the evict-first policy is there at all);
  * each wgmma instance of the small-batch kernel, and the prefill kernel, issues HGMMA in its
    sm_90a code (the other targets hold a trap stub that the planner never launches),
and prints a per-kernel instruction summary. Exits non-zero if a kernel fails.

    python scripts/check_sass.py [path/to/_C.so]
"""

import collections
import glob
import os
import re
import subprocess
import sys

OPS = r"LDGSTS|HMMA|HGMMA|LDSM|LOP3|HFMA2|HADD2|HMUL2|BAR|LDS|STS|LDG|STG|LDL|STL"
# marlin_smallm_kernel<MB, NW, STAGES, GROUPED, WG, ET, W, RG>: WG = true is the second bool after
# the three ints (Lb1E), followed by the element type and format arguments; every prefill kernel
WG_KERNEL = re.compile(r"marlin_smallm_kernelILi\d+ELi\d+ELi\d+ELb[01]ELb1E|marlin_prefill_kernel")


def written_uniform_regs(line):
    """Uniform registers an instruction writes (its first operand, a pair for .64 forms)."""
    m = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+(UR\d+)", line)
    if not m:
        return set()
    first = int(m.group(2)[2:])
    wide = ".64" in m.group(1) or m.group(1).startswith(("ULDC.64", "UMOV.64"))
    return {first, first + 1} if wide else {first}


def check_kernel(name, body, arch):
    lines = [l.split("*/", 1)[1] if "*/" in l else l for l in body.splitlines()]
    written, problems, descs = set(), [], collections.Counter()
    for line in lines:
        m = re.search(r"LDGSTS[.\w]*\s+\[[^\]]*\],\s*desc\[UR(\d+)\]", line)
        if m:
            ur = int(m.group(1))
            descs[ur] += 1
            if ur not in written or ur + 1 not in written:
                problems.append(f"LDGSTS uses desc[UR{ur}] before anything writes UR{ur}/UR{ur + 1}: {line.strip()[:100]}")
        written |= written_uniform_regs(line)
    # (kernels without cp.async pass: trap stubs, and the prefill kernel, which copies with TMA)
    if descs and len(descs) < 2:
        problems.append(f"only one descriptor register {dict(descs)} for all cp.async: no evict-first policy on the weights")
    ops = collections.Counter(re.findall(rf"\b({OPS})\b", body))
    # a wgmma instance built for sm_90a must issue HGMMA; elsewhere it is a trap stub by design
    if WG_KERNEL.search(name) and arch == "sm_90a" and ops["HGMMA"] == 0:
        problems.append("wgmma instance without HGMMA in its sm_90a code")
    return ops, descs, problems


def main():
    so = sys.argv[1] if len(sys.argv) > 1 else None
    if so is None:
        found = glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "marlin", "_C*.so"))
        if not found:
            print("no marlin/_C*.so found; build first")
            return 2
        so = found[0]
    sass = subprocess.run(["cuobjdump", "-sass", so], capture_output=True, text=True, check=True).stdout
    kernels = []
    # cuobjdump prints one "arch = sm_XX" header per embedded cubin, then its functions
    for part in re.split(r"\n(?=\s*arch = )", sass):
        arch = re.search(r"arch = (sm_\w+)", part)
        for body in re.split(r"\n\s*Function : ", part)[1:]:
            kernels.append((arch.group(1) if arch else "?", body))
    if not kernels:
        print("no kernels in", so)
        return 2
    bad = 0
    for arch, body in kernels:
        name = body.split("\n", 1)[0].strip()
        ops, descs, problems = check_kernel(name, body, arch)
        print(f"{name} [{arch}]\n   ops {dict(ops)}\n   cp.async descriptors {dict(descs)}")
        for p in problems:
            print("   PROBLEM:", p)
        bad += bool(problems)
    print(f"{len(kernels)} kernels checked, {bad} with problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
