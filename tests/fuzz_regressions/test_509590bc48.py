"""Fuzz regression (graphopt.tools.fuzz): [passes] eliminate_permutes raised InvariantError: graph lint failed: Argument 'clone' of Node 'gt' was used before it has been defined (a clone written in place through a slice was dropped, so the wr"""

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=2, S=4, D=8, inputs=('f32',), ops=(('inplace', 0, 'slice_fill'), ('inplace', 1, 'masked_fill_')), outputs=(2,), seed=1)
PASSES = ['eliminate_permutes']
TARGET = 'cpu'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
