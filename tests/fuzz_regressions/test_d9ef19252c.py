"""Fuzz regression (graphopt.tools.fuzz): the fuzz harness: bmm of a bf16 input and a bf16 cast fails in the fp64 reference (expected scalar type Double but found BFloat16); a program that does not run eagerly is now a 'program' failure, not """

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32', 'bf16'), ops=(('layer_norm', 0, False), ('cast', 2, 'bf16'), ('contiguous', 1), ('bmm', 4, 3), ('act', 5, 'relu')), outputs=(6,), seed=0)
PASSES = ['eliminate_dead_code']
TARGET = 'cpu'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
