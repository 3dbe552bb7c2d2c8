"""Fuzz regression (graphopt.tools.fuzz): [accuracy] graph after eliminate_permutes wrote into input 0 (the caller's tensor): the clone a slice assignment writes into was dropped as a no-op copy"""

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32',), ops=(('inplace', 0, 'slice_fill'), ('act', 1, 'relu')), outputs=(2,), seed=0)
PASSES = ['eliminate_permutes']
TARGET = 'cpu'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
