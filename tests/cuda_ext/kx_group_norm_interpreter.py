"""graphopt::group_norm's Triton kernel through Triton's interpreter (run in a fresh process by
test_group_norm.py: the interpreter must be on before triton is imported), tiles and splits made
small so every row takes several of each and both merges run."""
import torch
import torch.nn.functional as F

# (shape, groups, channels_last, act, affine)
CASES = [((2, 16, 7, 9), 1, False, "none", True), ((3, 32, 5, 5), 8, True, "silu", True),
         ((2, 12, 6, 7), 4, False, "gelu", False), ((1, 64, 3, 3), 32, True, "relu", True),
         ((4, 6, 33), 3, False, "silu", True), ((2, 8, 9, 10), 1, True, "none", True)]
ACT = {"none": lambda t: t, "relu": torch.relu, "silu": F.silu, "gelu": F.gelu}


def interpreter_cases():
    from graphopt.cuda_ext import group_norm_triton as gnt

    gnt.BLOCK, gnt.TARGET_PROGRAMS = 64, 24
    most = 0
    for shape, groups, cl, act, affine in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(sum(shape) + groups)
            x = (torch.randn(*shape, generator=g) * 2 + 40).to(dtype)  # a large mean: no cancellation
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
            w, b = (torch.randn(shape[1], generator=g).to(dtype) for _ in range(2)) if affine else (None, None)
            splits, _ = gnt.plan(shape[0] * groups, x[0].numel() // groups)
            most = max(most, splits)
            y = gnt.group_norm_triton(x, groups, w, b, 1e-5, act)
            assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last if cl else
                                                        torch.contiguous_format)
            d = lambda t: None if t is None else t.double()  # noqa: E731
            want = ACT[act](F.group_norm(x.double(), groups, d(w), d(b), 1e-5))
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * 4, msg=f"{shape} {groups} {act} {cl}")
    assert most >= 4, most  # rows split several ways: the merge of a row's splits ran
    print("interpreter cases ok")
