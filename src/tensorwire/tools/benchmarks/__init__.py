"""Benchmark machinery behind `tensorwire bench`.

`sweep` (sizes, cases, the timed loop, statistics) and `check` (inputs and the reference
check) are shared by tensorwire's own sweep and by the peer runners that time Gloo
(`gloo_runner`) and Open MPI (`mpi_runner`) for `--compare`; `compare` starts and interleaves
those launches, `report` prints and saves what they measured, `loadmeter` and `progress`
watch the machine and the sweep.
"""
