from narwhal.process.cli import main

raise SystemExit(main())
