"""Fuzz regression (graphopt.tools.fuzz, seed 101, 24 ops): [passes] fuse_elementwise raised InvariantError: a
group's early output (a relu chain read by a softmax) was read before the fused node, which has to come after
another input of the group (a softmax of the graph input); the graph was re-sorted only after the whole pass,
too late for the per-rewrite check"""

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32',), ops=(
    ('act', 0, 'relu'), ('act', 1, 'relu'), ('act', 2, 'relu'), ('act', 3, 'relu'), ('act', 4, 'relu'),
    ('act', 5, 'relu'), ('softmax', 6), ('act', 7, 'relu'), ('act', 8, 'relu'), ('act', 9, 'relu'), ('softmax', 0),
    ('contiguous', 9), ('act', 11, 'relu'), ('binary', 'add', 13, 'value', 6), ('act', 14, 'relu')),
    outputs=(15,), seed=0)
PASSES = ['fold_constants', 'fold_conv_bn', 'fuse_elementwise']
TARGET = 'h200'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
