"""madp: user-level differential privacy for ML data whose records belong to several people."""

from setuptools import find_packages, setup

MAPPED = {"madp.accounting": "accounting", "madp.beam": "beam_pipelines", "madp.training": "tf_training"}

setup(
    name="madp",
    version="0.1.0",
    description="Contribution bounding, min-sep batching, accounting and DP training for multi-user records",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # Import names live under madp. while the repo keeps its top-level folders: madp/accounting,
    # madp/beam and madp/training are links to them (so a checkout imports the same names without
    # installing), and the package mapping installs each from its folder. The mapped packages are
    # named here, since an sdist (what Dataflow stages with --setup_file) carries no links.
    packages=sorted(
        set(find_packages(include=["madp", "madp.*"]))
        | set(MAPPED)
        | {f"{name}.{sub}" for name, folder in MAPPED.items() for sub in find_packages(folder)}
    ),
    package_dir=MAPPED,
    install_requires=[
        "apache-beam==2.77.*",
        "attrs<24",  # dp-accounting 0.6 needs it
        "dp-accounting==0.6.0",
        "numpy>=2.0",
        "pyarrow>=15",
        "scipy>=1.11",
        "numba>=0.68",  # the compiled Monte Carlo kernels
        "google-crc32c>=1.5",  # TFRecord checksums
        "protobuf>=4",  # reading tf.train.Example in the batch verifier
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.6"],  # make test: a worker process per core
        "lint": ["ruff==0.17.*", "mypy==2.4.*"],
        "docs": ["sphinx==8.2.*", "myst-parser==5.*", "furo>=2025.12"],  # make docs
        "gcp": ["apache-beam[gcp]==2.77.*"],
        # Beam's file systems for s3:// and hdfs:// (the workers', and madp train's copy of batches there)
        "aws": ["apache-beam[aws]==2.77.*"],
        "hadoop": ["apache-beam[hadoop]==2.77.*"],
        # tensorflow-privacy==0.9.0 also, installed with --no-deps (its pins break TF 2.21; see Makefile)
        # gguf: reads (and the tests write) the GGUF files of pretrained models (--model causal-lm)
        "train": ["tensorflow-cpu==2.21.*", "tf-keras==2.21.*", "tensorboard==2.21.*", "gguf>=0.17,<1"],
        "report": ["matplotlib>=3.8"],
        # --runner pyspark: madp on Apache Spark (Java 17 or newer); pandas: PySpark's mapInArrow (DataFrame input)
        "spark": ["pyspark==4.3.*", "pandas>=2.2"],
        # --runner cuda of madp calibrate / epsilon (bandmf-minsep): the Monte Carlo samples on an NVIDIA GPU
        "cuda": ["numba-cuda[cu13]>=0.30", "cupy-cuda13x>=13"],
    },
    entry_points={"console_scripts": ["madp=madp.cli:main"]},
)
