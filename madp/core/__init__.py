"""The bottom layer: errors, records and their validation, storage, hashing and secret keys, the
bounding, sampling and routing kernels, the selection and batch file formats, TFRecords, and the
independent verifiers. Imports nothing of madp above it."""
