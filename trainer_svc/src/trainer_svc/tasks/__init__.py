"""Tasks the shipped configs train on, beyond a gold answer: their reward functions, named in a
config's [reward] as "trainer_svc.tasks.<module>:<function>" like any of a user's own."""
