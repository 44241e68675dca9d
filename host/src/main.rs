//! `host`: run, check and time Linear + epilogue blocks. See `host --help`.

fn main() {
    let code = match host::cli::run(std::env::args_os()) {
        Ok(()) => 0,
        Err(host::cli::Failure::Usage(e)) => {
            // clap formats help, version and usage errors itself.
            let _ = e.print();
            e.exit_code()
        }
        Err(host::cli::Failure::Run(e)) => {
            eprintln!("error: {e}");
            1
        }
        Err(host::cli::Failure::CheckFailed(what)) => {
            eprintln!("error: {what}");
            2
        }
    };
    std::process::exit(code);
}
