"""graphopt::group_norm's Triton kernel through Triton's interpreter (run in a fresh process by
test_group_norm.py: the interpreter must be on before triton is imported), tiles and splits made
small so every row takes several of each and both merges run; channels_last inputs take the
pixel-tile kernels where groups are narrow and a power of two wide (channel counts that are not a
power of two padded), the row kernels otherwise."""
import torch
import torch.nn.functional as F

# (shape, groups, channels_last, act, affine)
CASES = [((2, 16, 7, 9), 1, False, "none", True), ((3, 32, 5, 5), 8, True, "silu", True),
         ((2, 12, 6, 7), 4, False, "gelu", False), ((1, 64, 3, 3), 32, True, "relu", True),
         ((4, 6, 33), 3, False, "silu", True), ((2, 8, 9, 10), 1, True, "none", True),
         ((2, 20, 6, 7), 5, True, "gelu", True), ((3, 24, 4, 5), 8, True, "none", False),
         ((2, 30, 4, 5), 3, True, "relu", True),
         ((2, 128, 3, 4), 2, True, "silu", True)]
ACT = {"none": lambda t: t, "relu": torch.relu, "silu": F.silu, "gelu": F.gelu}


def interpreter_cases():
    from graphopt.cuda_ext import group_norm_triton as gnt

    gnt.BLOCK, gnt.TARGET_PROGRAMS = 64, 24
    most = most_cl = 0
    for shape, groups, cl, act, affine in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(sum(shape) + groups)
            x = (torch.randn(*shape, generator=g) * 2 + 40).to(dtype)  # a large mean: no cancellation
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
            w, b = (torch.randn(shape[1], generator=g).to(dtype) for _ in range(2)) if affine else (None, None)
            if cl and gnt.pixel_tiles(shape[1], groups):  # a sample's pixels split several ways, tiles of whole pixels
                most_cl = max(most_cl, gnt.plan_channels_last(shape[0], x[0, 0].numel(), shape[1])[0])
            else:
                most = max(most, gnt.plan(shape[0] * groups, x[0].numel() // groups)[0])
            y = gnt.group_norm_triton(x, groups, w, b, 1e-5, act)
            assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last if cl else
                                                        torch.contiguous_format)
            d = lambda t: None if t is None else t.double()  # noqa: E731
            want = ACT[act](F.group_norm(x.double(), groups, d(w), d(b), 1e-5))
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * 4, msg=f"{shape} {groups} {act} {cl}")
    assert most >= 4 and most_cl >= 4, (most, most_cl)  # rows split several ways: the merge of the splits ran
    print("interpreter cases ok")
