"""ffstate inside the training frameworks users already train with: ``lightning`` (PyTorch Lightning's
``ReplicationCallback``) and ``hf`` (the Hugging Face Trainer's ``ReplicationCallback`` and ``train``). Each module
imports its framework; nothing here does."""
