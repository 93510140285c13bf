"""Pipeline timing: the discrete-event simulator (the reference), the fast makespan estimators
(each tested against it), the dependency and ideal bounds, and a step's gap split into terms."""
