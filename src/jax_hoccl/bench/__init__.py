"""`python -m jax_hoccl.bench`: jax_hoccl against jax.lax (and the raw copy engine on GPUs) in
one run, a table and a results JSON; `--plot` turns a results JSON into figures. Sections:
collectives.py, fused.py, processes.py; report.py checks and prints results, plot.py draws."""
