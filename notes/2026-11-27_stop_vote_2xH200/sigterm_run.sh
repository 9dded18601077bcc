export PYTHONUNBUFFERED=1
python data/synthetic.py --out /tmp/syn --preset=bench > /dev/null 2>&1 || echo synth failed
O="--num_scheduled_iterations=30 --num_extension_iterations=3 --val_loss_every=10 --seed=0 --val_tokens=2097152 --train_files=/tmp/syn/fineweb_train_*.bin --val_files=/tmp/syn/fineweb_val_*.bin"
NPROC=2 ./run.sh $O --log_dir=$OUT/a > $OUT/run_a.txt 2>&1; echo "run a rc=$?"
grep -E "^step:[0-9]+/33 val|^result|error" $OUT/run_a.txt | tail -6
python bench/phase_times.py $OUT/a/*.txt | tail -8
NPROC=2 ./run.sh $O --log_dir=$OUT/b --run_id=sig --save_checkpoint > $OUT/run_b.txt 2>&1 &
pid=$!
for i in $(seq 600); do grep -q "^step:12/33" $OUT/run_b.txt && break; sleep 0.5; done
kill -TERM $pid; t0=$(date +%s.%N); wait $pid; rc=$?; t1=$(date +%s.%N)
echo "run b rc=$rc after SIGTERM, exit took $(echo "$t1 - $t0" | bc) s"
grep -c "^error:" $OUT/run_b.txt; grep -E "^error:|Traceback" $OUT/run_b.txt | head -3; ls $OUT/b/sig/ 2>/dev/null
