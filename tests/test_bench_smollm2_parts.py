"""What a device call sends (bench/smollm2_parts.py, which reports the room each call leaves for wheels): the
tracked files and the untracked ones git does not ignore, as they are on disk; ignored files and tracked files
deleted from disk count nothing."""
import subprocess

from bench.smollm2_parts import folder_bytes, travel_bytes


def test_travel_bytes_counts_tracked_and_unignored_files_only(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("ignored/\n")  # 9 bytes, untracked and not ignored
    (tmp_path / "tracked.py").write_bytes(b"x" * 100)
    (tmp_path / "gone.py").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "new.txt").write_bytes(b"x" * 20)
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big.bin").write_bytes(b"x" * 5000)
    subprocess.run(["git", "add", "tracked.py", "gone.py"], cwd=tmp_path, check=True)
    (tmp_path / "tracked.py").write_bytes(b"x" * 300)  # as it is on disk, not as staged
    (tmp_path / "gone.py").unlink()
    assert travel_bytes(tmp_path) == 9 + 300 + 20
    assert folder_bytes(tmp_path / "ignored") == 5000
    assert folder_bytes(tmp_path / "absent") == 0
