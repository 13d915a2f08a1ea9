"""Repository tools: `doc_blocks` runs the documentation's code blocks (tests/test_docs.py),
`make_hf_fixture` writes the HF checkpoint fixture the interop tests read (needs torch),
`gpu_check.sh` / `gpu_wheels.sh` the GPU session's one command and its wheels.
"""
