"""Fuzz regression (graphopt.tools.fuzz): [run] graph after eliminate_permutes fails to run: view size is not compatible with input tensor's size and stride (GroupNorm over a channels_last tensor: its eager output keeps the layout, its record"""

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32',), ops=(('group_norm', 0, 1, False, 'none', True), ('merge', 1)), outputs=(2,), seed=0)
PASSES = ['eliminate_permutes']
TARGET = 'cpu'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
