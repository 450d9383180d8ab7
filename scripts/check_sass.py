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
    sm_90a code (the other targets hold a trap stub that the planner never launches);
  * the prefill kernel's innermost wgmma loops (its consumers' stage loop) read no special
    register (S2R / S2UR): where too many values were live across that loop, ptxas re-derived the
    shared-memory base from SR_CgaCtaId before the first wgmma of every stage pair, and the kernel
    ran 3% slower at 4096 rows on an H200 (benchmarks/NOTES.md, 2026-11-28 tenth),
  * the stage loops of the 2:4 kernels with groups of 64 / 32 or zero points (marlin_24_kernel
    with FINE = true) hold at most MAX_FINE_24_LOOP_BRANCHES branches: a branch on the format
    around each 32-row strip's scale and zero-point code (17-26 per stage loop) kept ptxas from
    scheduling across the strips, and those kernels ran 1.08-1.16x slower at 1-16 rows on an H200
    (benchmarks/NOTES.md, 2026-11-29 nineteenth),
  * the stage loops of the small-batch kernel's one-block 8-row instances make at most
    MAX_ONE_BLOCK_8ROW_REMATS constants from uniform registers: ptxas rematerialised the raw
    path's correction fragment at every k16 step, 1-3% of the time at 1-8 rows on an H200
    (benchmarks/NOTES.md, 2026-11-29 thirty-second),
and prints a per-kernel instruction summary. Exits non-zero if a kernel fails.

    python scripts/check_sass.py [path/to/_C.so]     # cuobjdump -sass
    python scripts/check_sass.py path/to/x.cubin     # nvdisasm (e.g. nvcc -cubin of one source;
                                                     # pip's nvidia-cuda-nvdisasm has the tool)
    python scripts/check_sass.py x.cubin --loops marlin_24_kernel   # and, for the kernels whose
        # name matches the regex, each stage loop's (innermost HMMA / HGMMA loop's) instruction
        # count, branches and most frequent opcodes
"""

import collections
import glob
import os
import re
import shutil
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
    if PREFILL_KERNEL.search(name) and arch == "sm_90a":
        problems += stage_loop_problems(body)
    if FINE_24_KERNEL.search(name):
        problems += fine_24_loop_problems(body)
    if ONE_BLOCK_8ROW_KERNEL.search(name) and arch == "sm_90a":
        problems += one_block_8row_loop_problems(body)
    return ops, descs, problems


PREFILL_KERNEL = re.compile(r"marlin_prefill_kernel")
# marlin_24_kernel<MB, NW, MS, STAGES, WG, KW, ET, FINE> with FINE = true: its last template
# argument, mangled "Lb1E" before the argument list's end ("EEv" then the Params parameter)
FINE_24_KERNEL = re.compile(r"marlin_24_kernelI\w*Lb1EEEv")
MAX_FINE_24_LOOP_BRANCHES = 8  # 4-6 on sm_90a with CUDA 13.0 (the group-128 kernels' mma.sync loops: 4)
MMA_OP = r"\bHG?MMA\b"  # a stage loop's tensor-core instruction: mma.sync / mma.sp (HMMA) or wgmma (HGMMA)
# marlin_smallm_kernel<MB = 1, NW, STAGES, GROUPED, WG = false, ET, W, RG, MINB = 1>: the 8-row
# mma.sync instances without the 128-register bound (one block per SM)
ONE_BLOCK_8ROW_KERNEL = re.compile(r"marlin_smallm_kernelILi1ELi\d+ELi\d+ELb[01]ELb0E\w+?ELi1EEEv")
# A constant made in a stage loop from a negated uniform register (FADD Rn, -RZ, -URm): ptxas
# rematerialised the raw path's correction fragment that way at every k16 step (two per step, 8 per
# unrolled 4-stage loop), 1-3% of the time at 1-8 rows (benchmarks/NOTES.md, 2026-11-29
# thirty-second); the fragment is now built once. fp16 zero points keep one per stage.
REMAT_CONST = re.compile(r"\bFADD\b\s+R\d+,\s*-RZ,\s*-UR\d+")
MAX_ONE_BLOCK_8ROW_REMATS = 4


def instructions(body):
    """(labels, instructions) of a kernel's SASS: label name -> index, and the instruction texts
    (cuobjdump's and nvdisasm's "/*addr*/ OPCODE operands ;" lines) with their addresses."""
    labels, ins = {}, []
    for line in body.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    return labels, ins


def innermost_wgmma_loops(body):
    """The backward branches' ranges [target, branch] that hold an HGMMA, no exit and no smaller
    such range: the kernels' stage loops. Each as a list of instruction texts."""
    return innermost_loops(body, r"\bHGMMA\b")


def innermost_loops(body, op):
    """innermost_wgmma_loops for the instructions matching the regex `op` (e.g. HMMA or HGMMA)."""
    labels, ins = instructions(body)
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (_, text) in enumerate(ins):
        m = re.search(r"\bBRA\b[^`]*(?:`\((\.L_x_\d+)\)|\b0x([0-9a-f]+))", text)
        if not m:
            continue
        j = labels.get(m.group(1)) if m.group(1) else at.get(int(m.group(2), 16))
        span = [t for _, t in ins[j:i + 1]] if j is not None and j <= i else []
        # (a range over an EXIT is no loop: the out-of-line retries of an mbarrier wait sit after
        # the kernel's exits and branch back into the loop they came from)
        if any(re.search(op, t) for t in span) and not any(re.search(r"\b(EXIT|RET)\b", t) for t in span):
            loops.append((j, i))
    inner = [(j, i) for j, i in loops if not any((j2, i2) != (j, i) and j <= j2 and i2 <= i for j2, i2 in loops)]
    return [[t for _, t in ins[j:i + 1]] for j, i in inner]


def stage_loop_problems(body):
    """Special-register reads inside the innermost wgmma loops (see the module docstring)."""
    problems = []
    for loop in innermost_wgmma_loops(body):
        reads = [t for t in loop if re.search(r"\bS2U?R\b", t)]
        if reads:
            problems.append(f"a special-register read inside a {len(loop)}-instruction wgmma loop: {reads[0][:80]}")
    return problems


def loop_count_problems(body, pattern, limit, what):
    """Stage loops (innermost HMMA / HGMMA loops) holding more than `limit` instructions that match
    `pattern`; `what(n, loop_len, first_match)` words the problem."""
    problems = []
    for loop in innermost_loops(body, MMA_OP):
        hits = [t for t in loop if re.search(pattern, t)]
        if len(hits) > limit:
            problems.append(what(len(hits), len(loop), hits[0]))
    return problems


def fine_24_loop_problems(body):
    """Branches in the FINE 2:4 kernels' stage loops beyond MAX_FINE_24_LOOP_BRANCHES."""
    return loop_count_problems(
        body, r"\bBRA\b", MAX_FINE_24_LOOP_BRANCHES,
        lambda n, size, _: f"{n} branches in a {size}-instruction stage loop of a FINE 2:4 kernel "
                           f"(at most {MAX_FINE_24_LOOP_BRANCHES}: a branch on the format per strip?)")


def one_block_8row_loop_problems(body):
    """Constants rematerialised in the one-block 8-row instances' stage loops beyond the bound."""
    return loop_count_problems(
        body, REMAT_CONST, MAX_ONE_BLOCK_8ROW_REMATS,
        lambda n, size, first: f"{n} constants made from uniform registers in a {size}-instruction stage loop "
                               f"(at most {MAX_ONE_BLOCK_8ROW_REMATS}: the correction fragment rematerialised? {first[:60]})")


def nvdisasm():
    """nvdisasm on PATH, else the one of pip's nvidia-cuda-nvdisasm (site-packages/nvidia/*/bin)."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # the namespace package of NVIDIA's pip wheels

        for root in nvidia.__path__:
            hits = sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm")))
            if hits:
                return hits[-1]
    except ImportError:
        pass
    raise FileNotFoundError("nvdisasm not found: put it on PATH or pip install nvidia-cuda-nvdisasm")


def kernels_of(path):
    """(arch, body) per kernel: cuobjdump -sass of an extension, or nvdisasm of a cubin."""
    if path.endswith(".cubin"):
        sass = subprocess.run([nvdisasm(), "-c", path], capture_output=True, text=True, check=True).stdout
        target = re.search(r"^\s*\.target\s+(sm_\w+)", sass, re.M)  # nvdisasm's header names the cubin's arch
        arch = target.group(1) if target else "?"
        return [(arch, ".text." + b) for b in re.split(r"\n\.text\.", "\n" + sass)[1:]]
    sass = subprocess.run(["cuobjdump", "-sass", path], capture_output=True, text=True, check=True).stdout
    kernels = []
    # cuobjdump prints one "arch = sm_XX" header per embedded cubin, then its functions
    for part in re.split(r"\n(?=\s*arch = )", sass):
        arch = re.search(r"arch = (sm_\w+)", part)
        for body in re.split(r"\n\s*Function : ", part)[1:]:
            kernels.append((arch.group(1) if arch else "?", body))
    return kernels


def loop_summary(body):
    """One line per stage loop (innermost HMMA / HGMMA loop): instructions, branches, top opcodes."""
    out = []
    for loop in innermost_loops(body, MMA_OP):
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in loop)
        out.append(f"{len(loop)} instructions, {ops['BRA']} branches: " + " ".join(f"{o} {n}" for o, n in ops.most_common(12)))
    return out


def main():
    args = sys.argv[1:]
    loops_of = None
    if "--loops" in args:
        i = args.index("--loops")
        if i + 1 >= len(args):
            print("--loops needs a regex of kernel names, e.g. --loops marlin_24_kernel")
            return 2
        loops_of = re.compile(args[i + 1])
        del args[i:i + 2]
    so = args[0] if args else None
    if so is None:
        found = glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "marlin", "_C*.so"))
        if not found:
            print("no marlin/_C*.so found; build first")
            return 2
        so = found[0]
    kernels = kernels_of(so)
    if not kernels:
        print("no kernels in", so)
        return 2
    bad = 0
    for arch, body in kernels:
        name = body.split("\n", 1)[0].strip()
        ops, descs, problems = check_kernel(name, body, arch)
        print(f"{name} [{arch}]\n   ops {dict(ops)}\n   cp.async descriptors {dict(descs)}")
        if loops_of is not None and loops_of.search(name):
            for line in loop_summary(body):
                print("   stage loop:", line)
        for p in problems:
            print("   PROBLEM:", p)
        bad += bool(problems)
    print(f"{len(kernels)} kernels checked, {bad} with problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
