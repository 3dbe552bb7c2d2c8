"""Fuzz regression (graphopt.tools.fuzz, seed 1554, 39 ops): [passes] fuse_elementwise raised ProgramError: a
softmax and a roll's concatenation (relu chains between them) were one group, and a program cannot both reduce rows
and read a catin; the group now fuses without the concatenation"""

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32',), ops=(
    ('act', 0, 'relu'), ('act', 1, 'relu'), ('act', 2, 'relu'), ('act', 3, 'relu'), ('act', 4, 'relu'),
    ('roll', 5, 1, 1), ('act', 6, 'relu'), ('softmax', 7), ('act', 8, 'relu'), ('act', 9, 'relu'),
    ('act', 10, 'relu'), ('act', 11, 'relu'), ('act', 12, 'relu'), ('act', 13, 'relu'), ('act', 14, 'relu'),
    ('act', 15, 'relu'), ('act', 16, 'relu'), ('act', 17, 'relu'), ('act', 18, 'relu'), ('act', 19, 'relu'),
    ('act', 20, 'relu'), ('act', 21, 'relu'), ('act', 22, 'relu'), ('act', 23, 'relu'), ('act', 24, 'relu'),
    ('act', 25, 'relu'), ('act', 26, 'relu'), ('act', 27, 'relu'), ('act', 28, 'relu'), ('act', 29, 'relu'),
    ('rms_norm', 30), ('act', 31, 'relu'), ('act', 32, 'relu'), ('act', 33, 'relu'), ('act', 34, 'relu'),
    ('act', 35, 'relu'), ('act', 36, 'relu'), ('softmax', 37)),
    outputs=(38,), seed=0)
PASSES = ['eliminate_dead_code', 'eliminate_common_subexpressions', 'fold_constants', 'fuse_elementwise']
TARGET = 'cpu'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
