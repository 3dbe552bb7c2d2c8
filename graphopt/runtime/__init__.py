"""How optimized graphs run: CUDA-graph replay, placement across devices, pipelines, generation."""
