use clap::Parser;
use polyak::config::{Cli, Command};

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            polyak::telemetry::init_logging(args.log_format);
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("polyak-io")
                .build()?;
            runtime.block_on(polyak::server::serve(args))
        }
    }
}
