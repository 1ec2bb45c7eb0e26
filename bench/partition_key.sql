-- Issue 18: which column the runs history is partitioned by, measured on the two
-- reads the outcome write makes for every job (runs.services._latest_counted and the
-- (job, scheduled_for) clash probe). Run by hand against a scratch database:
--   createdb -h 127.0.0.1 -U postgres partkey
--   psql -h 127.0.0.1 -U postgres -d partkey -f bench/partition_key.sql
--   dropdb -h 127.0.0.1 -U postgres partkey
-- 1,000 jobs with one run an hour for 92 days (2.2 million finished runs) in 92 day
-- partitions plus an open partition, keyed two ways: by finished_at (by_end) and by
-- scheduled_for (by_time, with a default partition for times no day partition has); and
-- by_week: by_time's key in 14 week partitions, for the planning time.
\set ON_ERROR_STOP 1
\timing off
CREATE TABLE by_end (id bigint NOT NULL, job_id bigint NOT NULL, scheduled_for timestamptz NOT NULL,
  status varchar(16) NOT NULL, is_backfill bool NOT NULL DEFAULT false,
  finished_at timestamptz NOT NULL DEFAULT 'infinity') PARTITION BY RANGE (finished_at);
CREATE TABLE by_end_open PARTITION OF by_end FOR VALUES FROM ('infinity') TO (MAXVALUE);
CREATE TABLE by_time (id bigint NOT NULL, job_id bigint NOT NULL, scheduled_for timestamptz NOT NULL,
  status varchar(16) NOT NULL, is_backfill bool NOT NULL DEFAULT false, finished_at timestamptz,
  kept_for timestamptz NOT NULL DEFAULT 'infinity') PARTITION BY RANGE (kept_for);
CREATE TABLE by_time_open PARTITION OF by_time FOR VALUES FROM ('infinity') TO (MAXVALUE);
CREATE TABLE by_time_other PARTITION OF by_time DEFAULT;
CREATE TABLE by_week (LIKE by_time INCLUDING DEFAULTS) PARTITION BY RANGE (kept_for);
CREATE TABLE by_week_open PARTITION OF by_week FOR VALUES FROM ('infinity') TO (MAXVALUE);
CREATE TABLE by_week_other PARTITION OF by_week DEFAULT;
DO $$ DECLARE d date := date '2026-09-05'; BEGIN
  FOR i IN 0..91 LOOP
    EXECUTE format('CREATE TABLE by_end_d%s PARTITION OF by_end FOR VALUES FROM (%L) TO (%L)', i, (d+i)::timestamptz, (d+i+1)::timestamptz);
    EXECUTE format('CREATE TABLE by_time_d%s PARTITION OF by_time FOR VALUES FROM (%L) TO (%L)', i, (d+i)::timestamptz, (d+i+1)::timestamptz);
  END LOOP;
  FOR i IN 0..13 LOOP
    EXECUTE format('CREATE TABLE by_week_w%s PARTITION OF by_week FOR VALUES FROM (%L) TO (%L)', i, (d+7*i)::timestamptz, (d+7*i+7)::timestamptz);
  END LOOP; END $$;
CREATE INDEX ON by_end (job_id, scheduled_for);
CREATE UNIQUE INDEX ON by_time (job_id, kept_for, scheduled_for);
CREATE UNIQUE INDEX ON by_week (job_id, kept_for, scheduled_for);
INSERT INTO by_end (id, job_id, scheduled_for, status, finished_at)
SELECT row_number() OVER (), j, t, 'succeeded', t + interval '1 second'
FROM generate_series(1, 1000) j, generate_series(timestamptz '2026-09-05', timestamptz '2026-12-05 22:00', interval '1 hour') t;
INSERT INTO by_time SELECT id, job_id, scheduled_for, status, is_backfill, finished_at, scheduled_for FROM by_end;
INSERT INTO by_week SELECT * FROM by_time;
VACUUM ANALYZE by_end, by_time, by_week;
\echo by_end: the latest counted time of each of 200 jobs (a Merge Append of every partition)
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF) SELECT j, (SELECT scheduled_for FROM by_end r WHERE r.job_id = j
  AND NOT is_backfill AND status IN ('succeeded', 'dead', 'skipped') ORDER BY scheduled_for DESC LIMIT 1)
FROM generate_series(1, 200) j;
\echo by_end: does (job, time) have a run, for 200 jobs (every partition probed)
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF) SELECT j FROM generate_series(1, 200) j
WHERE EXISTS (SELECT 1 FROM by_end r WHERE r.job_id = j AND r.scheduled_for = timestamptz '2026-12-05 20:00');
\echo by_time: the same latest counted time (an ordered Append, newest day first, stops at the first row)
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF) SELECT j, (SELECT scheduled_for FROM by_time r WHERE r.job_id = j
  AND NOT is_backfill AND status IN ('succeeded', 'dead', 'skipped') AND kept_for >= '2026-09-05' AND kept_for < '2026-12-06'
  ORDER BY kept_for DESC LIMIT 1) FROM generate_series(1, 200) j;
\echo by_time: the same probe (pruned to the one partition of that time)
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF) SELECT j FROM generate_series(1, 200) j
WHERE EXISTS (SELECT 1 FROM by_time r WHERE r.job_id = j AND r.kept_for = timestamptz '2026-12-05 20:00'
  AND r.scheduled_for = timestamptz '2026-12-05 20:00');
\echo by_week: the same latest counted time over 14 week partitions
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF) SELECT j, (SELECT scheduled_for FROM by_week r WHERE r.job_id = j
  AND NOT is_backfill AND status IN ('succeeded', 'dead', 'skipped') AND kept_for >= '2026-09-05' AND kept_for < '2026-12-12'
  ORDER BY kept_for DESC LIMIT 1) FROM generate_series(1, 200) j;
\echo by_week: the same probe
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF) SELECT j FROM generate_series(1, 200) j
WHERE EXISTS (SELECT 1 FROM by_week r WHERE r.job_id = j AND r.kept_for = timestamptz '2026-12-05 20:00'
  AND r.scheduled_for = timestamptz '2026-12-05 20:00');
