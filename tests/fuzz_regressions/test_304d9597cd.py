"""Fuzz regression (graphopt.tools.fuzz): [accuracy] after fold_constants: max |err| 0.75 (a constant built with zeros and slice assignments was folded without its in-place writes)"""

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32',), ops=(('host_const', 0, 'slice_mask'),), outputs=(1,), seed=0)
PASSES = ['fold_constants']
TARGET = 'cpu'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
