"""Fuzz regression (graphopt.tools.fuzz): [passes] fuse_elementwise raised ProgramError: the program has no `out` statement (a dead pointwise chain)"""

import pytest

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32', 'bf16'), ops=(('act', 1, 'relu'), ('act', 2, 'relu'), ('act', 3, 'relu'), ('act', 4, 'relu'), ('act', 5, 'relu'), ('act', 6, 'relu'), ('linear', 0, 8, False)), outputs=(8,), seed=0)
PASSES = ['fold_constants', 'fuse_elementwise']
TARGET = 'cpu'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
