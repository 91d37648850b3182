"""Running a model for the faces: the engine (one thread owns every MLX call), its
process wrapper and client, the generation loop, sampling, the events the engine emits,
and BLAS thread control."""
