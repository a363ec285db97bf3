"""The card's memory: what each of the service's processes may hold of a GPU, and the environment
that keeps the libraries in them within it. Pure Python (no torch, vLLM or Ray): the application
builder, the LLM replica and the memory shard all import it."""
