"""scripts/sass_loops.py on hand-written SASS and ELF listings: which loops count as the ring's item loops and how
their local loads are counted (the nvcc test applies it to the real kernel where cuobjdump exists)."""
from __future__ import annotations

from scripts.sass_loops import functions, instructions, item_loops

ELF = """
   0x15    0x100    0x90  FUNC  LOCAL  DEFAULT  -  0x17  $amk_megakernel$_Z13amk_gemv_bodyI7AmkBF16Ev
   0x17    0x190    0x40  FUNC  LOCAL  DEFAULT  -  0x17  $amk_megakernel$_Z13amk_op_argmax
"""

SASS = """
        /*0100*/                   LDL R1, [R1+0x10] ;
        /*0110*/                   LDS.128 R4, [R8] ;
        /*0120*/                   LDL R2, [R2+0x38] ;
        /*0130*/                   FFMA R3, R4, R5, R3 ;
        /*0140*/              @P0  BRA 0x110 ;
        /*0150*/                   LDL R9, [R1+0xe0] ;
        /*0160*/                   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [R10+URZ], RZ ;
        /*0170*/                   STL [R1+0x8], R9 ;
        /*0180*/                   BRA 0x110 ;
        /*0190*/                   LDL R9, [R1+0xe0] ;
        /*01a0*/                   BRA 0x190 ;
"""


def test_functions_and_instructions_parse():
    f = functions(ELF)
    assert f["_Z13amk_gemv_bodyI7AmkBF16Ev"] == (0x100, 0x190)
    assert f["_Z13amk_op_argmax"] == (0x190, 0x1d0)
    ins = instructions(SASS)
    assert ins[0] == (0x100, "LDL R1, [R1+0x10]") and ins[-1] == (0x1a0, "BRA 0x190") and len(ins) == 11


def test_item_loop_is_the_innermost_loop_around_the_slot_release():
    ins = instructions(SASS)
    # loops in the body: 0x110..0x140 (no arrive) and 0x110..0x180 (holds the arrive at 0x160); the loop of the
    # next function (0x190..0x1a0) is outside the range
    (loop,) = item_loops(ins, 0x100, 0x190)
    assert (loop["start"], loop["end"], loop["instructions"]) == (0x10, 0x80, 8)
    assert (loop["ldl"], loop["stl"]) == (2, 1)   # 0x120 and 0x150; the store at 0x170 (0x100 is before the loop)
    assert item_loops(ins, 0x190, 0x1d0) == []     # no arrive: not a ring loop
