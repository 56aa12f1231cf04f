"""Engine plugins (shipped as atom_moe.plugins): vLLM (plugins/vllm) and SGLang (plugins/sglang).

Engine-neutral pieces (flags, start-up line, layer specs, start-up limits, warn-once) live
in atom_moe.plugins.common. Nothing here imports an engine; each engine package imports
its engine only once one of the ATOM_USE_FLYDSL flags is set.
"""
