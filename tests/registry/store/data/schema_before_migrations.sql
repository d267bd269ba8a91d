-- The store's schema as Store() created it before migrations existed (SQLite, "schema_version" 2), dumped from
-- sqlite_master of a store made by commit 4a05570. Tests create a store with it and upgrade that in place.
CREATE TABLE matrix_entries (
	id INTEGER NOT NULL,
	op VARCHAR(200) NOT NULL,
	composite VARCHAR(200) NOT NULL,
	kind VARCHAR(100) NOT NULL,
	stack VARCHAR(400) NOT NULL,
	pattern VARCHAR(100) NOT NULL,
	dtype VARCHAR(50) NOT NULL,
	status VARCHAR(20) NOT NULL,
	detail TEXT NOT NULL,
	max_abs_error FLOAT,
	max_rel_error FLOAT,
	source_hash VARCHAR(200) NOT NULL,
	torch_version VARCHAR(100) NOT NULL,
	device VARCHAR(50) NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_matrix_key UNIQUE (op, composite, stack, pattern, dtype, device, torch_version)
);
CREATE INDEX ix_matrix_entries_op ON matrix_entries (op);
CREATE TABLE profiles (
	id INTEGER NOT NULL,
	op VARCHAR(200) NOT NULL,
	composite VARCHAR(200) NOT NULL,
	kind VARCHAR(100) NOT NULL,
	stack VARCHAR(400) NOT NULL,
	workload VARCHAR(100) NOT NULL,
	dtype VARCHAR(50) NOT NULL,
	device VARCHAR(50) NOT NULL,
	device_name VARCHAR(200) NOT NULL,
	numel_bucket INTEGER NOT NULL,
	batch_size INTEGER NOT NULL,
	valid INTEGER NOT NULL,
	detail TEXT NOT NULL,
	median_us FLOAT,
	iqr_us FLOAT,
	runs INTEGER NOT NULL,
	peak_memory INTEGER,
	source_hash VARCHAR(200) NOT NULL,
	torch_version VARCHAR(100) NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_profile_key UNIQUE (op, composite, workload, dtype, device, device_name, numel_bucket, batch_size, torch_version)
);
CREATE INDEX ix_profiles_op ON profiles (op);
CREATE TABLE store_meta (
	"key" VARCHAR(100) NOT NULL,
	value INTEGER NOT NULL,
	PRIMARY KEY ("key")
);
CREATE TABLE jobs (
	id VARCHAR(64) NOT NULL,
	kind VARCHAR(50) NOT NULL,
	params TEXT NOT NULL,
	state VARCHAR(20) NOT NULL,
	done INTEGER NOT NULL,
	total INTEGER NOT NULL,
	result TEXT,
	error TEXT,
	owner VARCHAR(300) NOT NULL,
	created_at FLOAT NOT NULL,
	started_at FLOAT,
	finished_at FLOAT,
	updated_at FLOAT NOT NULL,
	PRIMARY KEY (id)
);
CREATE INDEX ix_jobs_state ON jobs (state);
CREATE TABLE bench_runs (
	id INTEGER NOT NULL,
	kind VARCHAR(50) NOT NULL,
	host VARCHAR(300) NOT NULL,
	pid INTEGER NOT NULL,
	started_at FLOAT NOT NULL,
	finished_at FLOAT,
	PRIMARY KEY (id)
);
CREATE TABLE survey_results (
	id INTEGER NOT NULL,
	torch_version VARCHAR(100) NOT NULL,
	op VARCHAR(200) NOT NULL,
	opinfo_name VARCHAR(200) NOT NULL,
	variant_test_name VARCHAR(200) NOT NULL,
	stack VARCHAR(100) NOT NULL,
	batching VARCHAR(20) NOT NULL,
	dtype VARCHAR(50) NOT NULL,
	native_status VARCHAR(20) NOT NULL,
	native_detail TEXT NOT NULL,
	use_status VARCHAR(20) NOT NULL,
	use_detail TEXT NOT NULL,
	max_abs_error FLOAT,
	max_rel_error FLOAT,
	samples INTEGER NOT NULL,
	timestamp VARCHAR(40) NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_survey_key UNIQUE (torch_version, op, stack, batching, dtype)
);
CREATE INDEX ix_survey_results_op ON survey_results (op);
