"""Run: every run a report needs (oracle, fp64 reference, helper runs, candidates), each measured, kept and saveable before anything is compared."""
