"""One module per ``torch.ops.graphopt`` op, named after it: its schema, reference, fake, CUDA
dispatch, wrapper with argument checks and cost function, declared with
``graphopt.cuda_ext.registry.define_op`` (see ``cuda_ext/README.md``, "Adding an op").
``registry.all_ops()`` imports every module here; modules starting with ``_`` are not ops."""
