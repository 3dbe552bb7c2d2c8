"""Fuzz regression (graphopt.tools.fuzz): [passes] eliminate_permutes (in ['eliminate_permutes'], target cpu) raised InvariantError: graph lint failed after eliminate_permutes: Argument 'transpose' of Node 'output' was used before it has been"""

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32',), ops=(('act', 0, 'relu'), ('act', 1, 'relu'), ('act', 2, 'relu'), ('transpose', 3), ('transpose', 4), ('softmax', 5), ('transpose', 5)), outputs=(7,), seed=0)
PASSES = ['eliminate_permutes']
TARGET = 'cpu'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
