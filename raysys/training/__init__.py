"""Training steps: the timed train step (`step`), the leaderboard step (`leaderboard`), its benchmark
(`leaderboard_bench`) and the `bench` command's run (`bench`)."""
