//! placeholder
use clap::Args;
#[derive(Debug, Args)]
pub struct SweepArgs {}
#[derive(Debug, Args)]
pub struct ReportArgs {}
#[derive(Debug, Args)]
pub struct RecommendArgs {}
pub fn run_sweep(_a: SweepArgs) -> anyhow::Result<i32> { Ok(0) }
pub fn run_report(_a: ReportArgs) -> anyhow::Result<i32> { Ok(0) }
pub fn run_recommend(_a: RecommendArgs) -> anyhow::Result<i32> { Ok(0) }
