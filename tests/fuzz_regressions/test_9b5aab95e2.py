"""Fuzz regression (graphopt.tools.fuzz): [passes] fuse_rms_norm (in ['fuse_rms_norm'], target h200) raised InvariantError: graph lint failed after fuse_rms_norm: Argument 'to' of Node 'add_rms_norm_default_1' was used before it has been defi"""

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32',), ops=(('rms_norm', 0), ('rms_norm', 0)), outputs=(2,), seed=0)
PASSES = ['fuse_rms_norm']
TARGET = 'h200'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
