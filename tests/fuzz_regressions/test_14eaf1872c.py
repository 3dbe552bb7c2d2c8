"""Fuzz regression (graphopt.tools.fuzz): [accuracy] after fuse_elementwise, target h200: max |err| 1 (a reader of the fused kernel's first value came before the in-place writes to a tensor it reads; reordering moved the kernel across them)"""

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32',), ops=(('act', 0, 'relu'), ('merge', 1), ('host_const', 1, 'slice_mask')), outputs=(3,), seed=0)
PASSES = ['fuse_elementwise']
TARGET = 'h200'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
