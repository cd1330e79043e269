"""On-device runtimes (llama.cpp first), device profiles and the memory-budget planner."""
