"""Fuzz regression (graphopt.tools.fuzz, benchmarks/fuzz.py --seed 7 --max-ops 14): [passes] fuse_attention raised IndexError: list index out of range. Self-attention reads one node as q, k and v; the cost model took SDPA's k from the de-duplicated input list."""

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32',), ops=(('split', 0), ('attention', 1, 1, 1, False), ('act', 2, 'relu')), outputs=(3,), seed=0)
PASSES = ['fuse_attention']
TARGET = 'h200'
MODE = 'passes'


def test_reproduces():
    check_program(PROGRAM, PASSES, TARGET, MODE)
