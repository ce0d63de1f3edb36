import os
import sys
import warnings

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# every CPU virtual device runs with the stream checking mode (DESIGN.md section 4); subprocesses inherit it
os.environ.setdefault("LIGHTNING_ROUNDPIPE_CHECK_STREAMS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests/_helpers.py importable (also from subprocesses)
warnings.filterwarnings("ignore", message=".*LeafSpec.*")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
