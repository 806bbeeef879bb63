"""Pipeline planning, pure: Seq1F1B segments, InfiniPipe chunking, the 1F1B schedule and its simulator, the
checkpointing ILP, the per-stage memory model and the staged plan (stages x SP groups) a pipelined step runs."""
