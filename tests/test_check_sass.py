"""scripts/check_sass.py's stage-loop check on hand-written SASS in both tools' formats: a special
register read inside the innermost wgmma loop is flagged, one outside it or in an mbarrier wait's
out-of-line retry is not (the check itself runs on the prefill kernel's real SASS in .ci/run and
scripts/gpu_check.sh)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import check_sass  # noqa: E402

# nvdisasm -c: labels, branches to them, an EXIT, and a retry stub after it that branches back
NVDISASM = """
        /*0000*/                   S2UR UR4, SR_CgaCtaId ;
.L_x_1:
        /*0010*/                   UIADD3 UR5, UR4, 0x40, URZ ;
.L_x_2:
        /*0020*/                   {S2UR}
        /*0030*/                   HGMMA.64x256x16.F32 R24, R160, gdesc[UR8], R24 ;
        /*0040*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR20], R4 ;
        /*0050*/               @!P0 BRA `(.L_x_9) ;
.L_x_3:
        /*0060*/                   HGMMA.64x256x16.F32 R24, R152, gdesc[UR8], R24, gsb0 ;
        /*0070*/               @!P1 BRA `(.L_x_2) ;
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x3, 0x100 ;
        /*0090*/               @!P2 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
.L_x_9:
        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR20], R4 ;
        /*00c0*/                   BRA `(.L_x_3) ;
"""

# cuobjdump -sass: numeric branch targets, encodings after each instruction
CUOBJDUMP = """
        /*0000*/                   S2R R0, SR_TID.X ;                          /* 0x0000000000007919 */
        /*0010*/                   MOV R1, c[0x0][0x28] ;                      /* 0x00000a0000017a02 */
        /*0020*/                   {S2UR}                                      /* 0x0000000000007919 */
        /*0030*/                   HGMMA.64x128x16.F32 R24, R88, gdesc[UR12], R24 ;   /* 0x0 */
        /*0040*/               @!P0 BRA 0x20 ;                                 /* 0x0 */
        /*0050*/                   EXIT ;                                      /* 0x0 */
"""


def _body(text, inside):
    read = "S2UR UR31, SR_CgaCtaId ;" if inside else "NOP ;"
    return "marlin_prefill_kernel\n" + text.replace("{S2UR}", read)


def test_stage_loop_found():
    loops = check_sass.innermost_wgmma_loops(_body(NVDISASM, False))
    assert len(loops) == 1 and len(loops[0]) == 6, loops  # .L_x_2 .. the branch back to it
    loops = check_sass.innermost_wgmma_loops(_body(CUOBJDUMP, False))
    assert len(loops) == 1 and len(loops[0]) == 3, loops


def test_special_register_in_stage_loop_flagged():
    for text in (NVDISASM, CUOBJDUMP):
        assert check_sass.stage_loop_problems(_body(text, False)) == []
        problems = check_sass.stage_loop_problems(_body(text, True))
        assert len(problems) == 1 and "SR_CgaCtaId" in problems[0], problems


def test_prefill_kernels_only_at_sm90a():
    body = _body(NVDISASM, True)
    assert check_sass.check_kernel("marlin_prefill_kernel<...>", body, "sm_90a")[2]
    assert not check_sass.check_kernel("marlin_prefill_kernel<...>", body, "sm_80")[2]


# a FINE 2:4 kernel's stage loop (mma.sync): `branches` forward branches around scale code
def _fine_24(branches):
    lines = [".L_x_1:", "        /*0000*/                   LDS.128 R12, [R44] ;"]
    addr = 0x10
    for i in range(branches):
        lines += [f"        /*{addr:04x}*/               @!P3 BRA `(.L_x_{100 + i}) ;",
                  f"        /*{addr + 0x10:04x}*/                   HMUL2 R16, R16, R12.H0_H0 ;",
                  f".L_x_{100 + i}:"]
        addr += 0x20
    lines += [f"        /*{addr:04x}*/                   HMMA.SP.16832.F32 R40, R16, R36, R40, R52, 0x0 ;",
              f"        /*{addr + 0x10:04x}*/               @!P1 BRA `(.L_x_1) ;",
              f"        /*{addr + 0x20:04x}*/                   EXIT ;"]
    return "\n".join(lines)


FINE_NAME = "_ZN6marlin8sparse2416marlin_24_kernelILi1ELi4ELi1ELi4ELi0ELi1E6__halfLb1EEEvNS0_6ParamsE"
PLAIN_NAME = FINE_NAME.replace("Lb1EEEv", "Lb0EEEv")


def test_fine_24_stage_loop_branches():
    """The FINE 2:4 kernels' stage loops may branch a few times (the loop's own branch, the
    refill's), not once per strip and block around the scales (the kernel before had 25)."""
    few, many = _fine_24(3), _fine_24(25)
    assert check_sass.check_kernel(FINE_NAME, few, "sm_90a")[2] == []
    problems = check_sass.check_kernel(FINE_NAME, many, "sm_90a")[2]
    assert len(problems) == 1 and "26 branches" in problems[0], problems
    bf16 = FINE_NAME.replace("6__half", "13__nv_bfloat16")
    assert check_sass.check_kernel(bf16, many, "sm_80")[2]
    # the group-128 / per-column kernels are not held to it (their wgmma loop branches on the format)
    assert check_sass.check_kernel(PLAIN_NAME, many, "sm_90a")[2] == []


def test_loop_summary_counts_the_stage_loop():
    (line,) = check_sass.loop_summary(_fine_24(3))
    assert line.startswith("9 instructions, 4 branches") and "HMUL2 3" in line and "HMMA 1" in line, line


# the one-block 8-row small-batch instance's stage loop, with a constant made from a uniform
# register at every k16 step (REMAT copies of "FADD R24, -RZ, -UR4")
ONE_BLOCK = "marlin_smallm_kernelILi1ELi4ELi4ELb1ELb0E6__halfLi0ELi0ELi1EEEvNS_12KernelParamsE"


def _one_block_loop(remats):
    steps = "".join(f"""
        /*{0x100 + 0x20 * i:04x}*/                   FADD R24, -RZ, -UR4 ;
        /*{0x110 + 0x20 * i:04x}*/                   HMMA.16816.F32 R88, R24, R96, R88 ;""" for i in range(remats))
    return f"""
.L_x_1:
        /*0000*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0010*/                   HMMA.16816.F32 R20, R76, R108, R20 ;{steps}
        /*0ff0*/               @P0 BRA `(.L_x_1) ;
        /*1000*/                   EXIT ;
"""


def test_one_block_8row_remats_flagged_beyond_one_per_stage():
    assert check_sass.ONE_BLOCK_8ROW_KERNEL.search(ONE_BLOCK)
    assert not check_sass.ONE_BLOCK_8ROW_KERNEL.search(ONE_BLOCK.replace("Li0ELi1EEEv", "Li0ELi2EEEv"))  # MINB 2
    assert not check_sass.ONE_BLOCK_8ROW_KERNEL.search(ONE_BLOCK.replace("ELb1ELb0E", "ELb1ELb1E"))  # wgmma
    assert check_sass.one_block_8row_loop_problems(_one_block_loop(4)) == []
    problems = check_sass.one_block_8row_loop_problems(_one_block_loop(8))
    assert len(problems) == 1 and "8 constants" in problems[0]
    assert check_sass.check_kernel(ONE_BLOCK, _one_block_loop(8), "sm_90a")[2] == problems
    assert check_sass.check_kernel(ONE_BLOCK, _one_block_loop(8), "sm_80")[2] == []  # the bound is sm_90a's
