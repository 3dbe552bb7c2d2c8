"""Fuzz regression (graphopt.tools.fuzz): [passes] fuse_attention raised InvariantError: graph lint failed: Argument 'matmul_1' of Node 'scaled_dot_product_attention_default_1' was used before it has been defined (the second attention's plan """

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32',), ops=(('split', 0), ('attention', 1, 1, 1, False), ('attention', 2, 2, 2, False)), outputs=(3,), seed=0)
PASSES = ['fuse_attention']
TARGET = 'h200'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
