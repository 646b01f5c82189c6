"""`phoenixft simulate`: the failure simulator (model.py), the published failure rates it
draws from (rates.py), its inputs measured by the benchmarks (measured.py, which reads
their JSON and needs no benchmark code), its check against a goodput run (validate.py),
its report (report.py) and its command (cli.py)."""
