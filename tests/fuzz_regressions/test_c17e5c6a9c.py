"""Fuzz regression (graphopt.tools.fuzz): [run] graph after eliminate_permutes fails to run: view size is not compatible with input tensor's size and stride (relu of a channels_last group_norm: the CPU kernel keeps channels_last, its meta say"""

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32',), ops=(('softmax', 0), ('binary', 'add', 1, 'value', 1), ('attention', 2, 2, 2, True), ('act', 3, 'relu'), ('act', 4, 'relu'), ('group_norm', 5, 1, False, 'relu', True), ('host_const', 5, 'arange_bias'), ('merge_heads', 7), ('act', 8, 'relu'), ('merge', 6), ('act', 10, 'relu'), ('act', 11, 'relu')), outputs=(12,), seed=0)
PASSES = ['eliminate_permutes']
TARGET = 'cpu'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
