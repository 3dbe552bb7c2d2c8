"""Fuzz regression (tests/test_fuzz.py's hypothesis run with the oldest supported versions): [passes] fuse_elementwise
raised RuntimeError (a broadcast of the pad's mask [5, 1] against [1, 4, 8]): a pad whose operand is the graph's input
itself, then two ReLUs, fused; the input was not read through the catin of zero pieces because only nodes under the
pad, not the pad, counted as reading through it"""

from graphopt.tools.fuzz import Program, check_program

PROGRAM = Program(B=1, S=4, D=8, inputs=('f32',), ops=(('pad', 0, 1, 1, 0, 0.0), ('act', 1, 'relu'), ('act', 2, 'relu')),
                  outputs=(3,), seed=0)
PASSES = ['eliminate_dead_code', 'eliminate_common_subexpressions', 'fold_constants', 'fuse_elementwise']


def test_reproduces():
    check_program(PROGRAM, PASSES, 'h200', 'passes')


def test_reproduces_with_every_rewrite_applied():
    check_program(PROGRAM, PASSES, 'h200', 'passes', ignore_cost=True)
